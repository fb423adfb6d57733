"""The state directory: what must survive a restart (the outbox), and who this daemon is.

    --state-dir DIR  >  [daemon] state_dir  >  $STATE_DIRECTORY (systemd's StateDirectory=)
                     >  $XDG_STATE_HOME/edgeline  >  ~/.local/state/edgeline

Each bundle gets ``DIR/<bundle name>/``, locked while a daemon uses it (a second daemon on the same directory
would share, and fight over, one outbox and one client id: it is refused at start). The instance id, which names
the daemon in its client id, its availability and status topics and every result, is derived from the host name,
the machine's identity and the directory: stable across restarts of one instance, different between instances.

Devices flashed from one image share a host name and a state path; what tells them apart is the machine's
identity: ``/etc/machine-id`` (which an image prepared for cloning leaves empty and systemd fills at first boot)
and the board's own serial number where the hardware has one (a Raspberry Pi's, in the device tree), which no
cloning copies. Moving an SD card to another board therefore makes another instance, as it should.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import socket
from pathlib import Path
from typing import IO

from edgeline.errors import EdgelineError

__all__ = ["StateLock", "default_state_dir", "instance_id"]


def default_state_dir() -> Path:
    systemd = os.environ.get("STATE_DIRECTORY")
    if systemd:
        return Path(systemd.split(":")[0])
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "state"
    return base / "edgeline"


MACHINE_IDENTITY = (
    Path("/etc/machine-id"),
    Path("/var/lib/dbus/machine-id"),
    Path("/sys/firmware/devicetree/base/serial-number"),
    Path("/proc/device-tree/serial-number"),
)
"""Where the machine's identity is read: systemd's machine id (dbus' copy where systemd is absent) and the
board's serial number (Raspberry Pi, other device-tree boards). Those that exist are all used."""


def machine_identity(sources: tuple[Path, ...] = MACHINE_IDENTITY) -> str:
    """The machine's identity from ``sources`` (empty when none can be read)."""
    parts = []
    for path in sources:
        try:
            text = path.read_bytes()[:256].decode("ascii", "replace").strip("\x00 \n\t")
        except OSError:
            continue
        if text:
            parts.append(f"{path}={text}")
    return "\n".join(parts)


def instance_id(state_dir: Path, *, identity: str | None = None) -> str:
    """``<host>-<8 hex digits of the machine's identity and the state directory's path>``, safe in topics and
    client ids."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).strip("-")[:32] or "host"
    machine = machine_identity() if identity is None else identity
    digest = hashlib.sha256(f"{machine}\n{state_dir.resolve()}".encode()).hexdigest()[:8]
    return f"{host}-{digest}"


class StateLock:
    """An exclusive lock on ``directory`` (created if needed) for this process's lifetime."""

    def __init__(self, directory: Path):
        self.directory = directory
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self._file: IO[str] = open(directory / "lock", "a+", encoding="utf-8")  # noqa: SIM115 - held until release
        except OSError as exc:
            raise EdgelineError(f"state directory {directory}: {exc.strerror or exc}") from exc
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            self._file.seek(0)
            owner = self._file.read().strip() or "another process"
            self._file.close()
            raise EdgelineError(
                f"state directory {directory} is in use by {owner}; give each daemon its own --state-dir"
            ) from exc
        try:  # who holds it, for the refusal of a second daemon; on a full disk it goes unsaid
            self._file.seek(0)
            self._file.truncate()
            self._file.write(f"edgeline run (pid {os.getpid()})\n")
            self._file.flush()
        except OSError:
            pass

    def release(self) -> None:
        if not self._file.closed:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
