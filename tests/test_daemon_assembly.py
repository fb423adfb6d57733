"""The daemon is built ready (``edgeline.daemon.assembly.assemble``), then handed over (``Service``).

What a file or a socket sees is observed through the interpreter's audit events (PEP 578: every ``open``, every
socket and SQLite connection raises one), so these tests count the real reads of a real bundle: nothing stands in
for the bundle, the model or the update state. No broker is started: the daemons here are built and never run.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from edgeline.daemon.config import DaemonConfig

pytestmark = pytest.mark.quick

WATCHED = ("open", "os.mkdir", "socket.connect", "socket.bind", "socket.__new__", "sqlite3.connect", "os.listdir")
"""The audit events that are I/O a constructor must not do."""


class _Audit:
    """One audit hook for the whole process (hooks cannot be removed): it records only while a test listens."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.listening: list[tuple[int, str, tuple[Any, ...]]] | None = None
        self.thread = 0
        sys.addaudithook(self.hook)

    def hook(self, event: str, args: tuple[Any, ...]) -> None:
        found = self.listening
        if found is not None and event in WATCHED and threading.get_ident() == self.thread:
            found.append((len(found), event, args))


_AUDIT: _Audit | None = None


@contextmanager
def audited() -> Iterator[list[tuple[int, str, tuple[Any, ...]]]]:
    """The watched audit events this thread raises inside the block."""
    global _AUDIT
    if _AUDIT is None:
        _AUDIT = _Audit()
    found: list[tuple[int, str, tuple[Any, ...]]] = []
    with _AUDIT.lock:
        _AUDIT.thread, _AUDIT.listening = threading.get_ident(), found
        try:
            yield found
        finally:
            _AUDIT.listening = None


def opened(events: list[tuple[int, str, tuple[Any, ...]]], path: Path) -> int:
    """How many times ``path`` was opened."""
    return sum(1 for _, event, args in events if event == "open" and args and _same(args[0], path))


def _same(what: Any, path: Path) -> bool:
    if isinstance(what, bytes):
        what = what.decode(errors="replace")
    if not isinstance(what, str | Path):
        return False
    return Path(what).resolve() == path.resolve()


def configuration(tmp_path: Path, *, broker: bool) -> DaemonConfig:
    """Updates on (a repository and a trusted root: the client reads the root's bytes only), a state directory of
    the test's own; with ``broker``, the MQTT source at QoS 1 (a source that can wait: the intake gate is built)."""
    repository = tmp_path / "repo"
    (repository / "metadata").mkdir(parents=True)
    root = tmp_path / "root.json"
    root.write_text("{}")
    replay = tmp_path / "inputs.jsonl"
    replay.write_text("")
    data: dict[str, Any] = {
        "daemon": {"state_dir": str(tmp_path / "state"), "instance": "assembly-test"},
        "updates": {"repository": str(repository), "trusted_root": str(root)},
    }
    if broker:  # never connected to: the daemon is not started
        data["broker"] = {"host": "127.0.0.1", "port": 1}
        data["input"] = {"subscribe": ["edgeline-assembly-test/+/in"], "qos": 1}
        data["output"] = {"publish": "edgeline-assembly-test/{device}/out"}
    else:
        data["source"] = {"kind": "replay", "path": str(replay)}
    return DaemonConfig.model_validate(data)


def test_a_daemon_with_updates_parses_its_manifest_once_and_hashes_its_files_once(
    built_litert_bundle: Path, tmp_path: Path
) -> None:
    """The update state, the compiled-model cache and the model are given the bundle as read once: its manifest
    parsed once and each file it lists hashed once (it was 3 and 2 with updates on)."""
    from edgeline.bundle import read_manifest
    from edgeline.daemon.service import Daemon

    manifest = read_manifest(built_litert_bundle)
    listed = [built_litert_bundle / entry.path for entry in manifest.files if entry.path != manifest.model]
    assert listed, "the bundle lists files besides its model"
    config = configuration(tmp_path, broker=False)
    with audited() as events:
        daemon = Daemon(built_litert_bundle, config)
    try:
        assert opened(events, built_litert_bundle / "manifest.json") == 1, [e for e in events if e[1] == "open"]
        for path in listed:
            assert opened(events, path) == 1, (path, [e for e in events if e[1] == "open"])
        assert daemon.updater is not None and daemon.model.name == manifest.name
    finally:
        daemon.stop()  # the state directory's lock, taken for the update state


def test_the_service_takes_its_parts_built_and_wired_and_does_no_io(built_litert_bundle: Path, tmp_path: Path) -> None:
    """``assemble`` builds every part with its neighbours (the delivery path, the intake gate, the network tick,
    the update agent's swap) and ``Service`` only takes them: no file, socket or database is touched by its
    constructor, and no part is wired to another after it was made."""
    from edgeline.daemon.assembly import assemble
    from edgeline.daemon.service import Service

    assembled = assemble(built_litert_bundle, configuration(tmp_path, broker=True))
    with audited() as events:
        service = Service(assembled)
    try:
        assert events == []
        delivery, network, swap, updater = assembled.delivery, assembled.network, assembled.swap, assembled.updater
        assert delivery is not None and network is not None and swap is not None and updater is not None
        assert service.sinks.delivery is delivery and network.delivery is delivery and network.sinks is service.sinks
        assert updater.swap is swap and service.worker.swap is swap and swap.processor is service.processor
        assert swap.agent is updater and service.reporter.updater is updater
        assert service.intake.gate is not None  # MQTT at QoS 1: a source that can wait
        # nothing is open until start: the outbox opens under the state directory's lock then
        assert not delivery.opened and service.delivery is None and service.outbox is None
        assert service.reporter.network is None and service.gate is service.intake.gate
    finally:
        service.stop()
