"""How a device downloads: every file of a check (metadata and archives alike) whole within one deadline, no longer
than the limit python-tuf gives, into a temporary file on the state directory's disk.

    BoundedFetcher  python-tuf's ``FetcherInterface``; its ``download_file`` (what ``Updater`` calls for every file)
                    spools into ``spool`` (the state directory's ``downloads/``, which the room check counts; never
                    ``$TMPDIR``), refuses a file at once when it outgrows ``max_length`` (when the server announces
                    it, before a byte of it) and gives a download up at its deadline (``SlowRetrievalError``)
    HttpFetcher     HTTP(S) over ``http.client``: every read of the socket, the response's headers as much as its
                    body, waits at most until the deadline (and 30 s for any byte), so a server that trickles a byte
                    every second keeps a check no longer than ``download_timeout_s``; proxies from ``http_proxy``,
                    ``https_proxy``, ``all_proxy`` and ``no_proxy``; up to 5 redirects
    LocalFetcher    a directory or ``file://`` (a USB stick): regular files only, checked before they are opened and
                    again after, so a FIFO never blocks a check and a device's endless bytes are never read

The deadline is the download's, not the check's: a check reads the timestamp, snapshot and targets metadata (and
any new root) and then the archive, each within ``download_timeout_s``.
"""

from __future__ import annotations

import base64
import http.client
import os
import socket
import ssl
import stat
import tempfile
import time
import urllib.request
from collections.abc import Generator, Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, BinaryIO
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit

from edgeline.updates.policy import DOWNLOAD_TIMEOUT_S

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

__all__ = [
    "SOCKET_TIMEOUT_S",
    "BoundedFetcher",
    "Deadline",
    "HttpFetcher",
    "LocalFetcher",
    "NotRegularFile",
    "open_regular",
]

SOCKET_TIMEOUT_S = 30.0
"""The longest wait for any byte (python-tuf's own): a link gone silent is given up before the deadline."""
CHUNK = 1 << 16
MAX_REDIRECTS = 5
REDIRECTS = frozenset({301, 302, 303, 307, 308})
USER_AGENT = "edgeline-updates"


def _fetcher_base() -> type:
    from tuf.ngclient import FetcherInterface

    return FetcherInterface


class Deadline:
    """The end of one download."""

    def __init__(self, url: str, seconds: float):
        self.url = url
        self.seconds = seconds
        self.end = time.monotonic() + seconds
        self.last_wait_was_the_deadline = False

    def remaining(self) -> float:
        """Seconds left; none left, the download is given up."""
        left = self.end - time.monotonic()
        if left <= 0:
            raise self.passed()
        return left

    def wait(self) -> float:
        """How long the next read of the socket may wait for a byte."""
        left = self.remaining()
        self.last_wait_was_the_deadline = left < SOCKET_TIMEOUT_S
        return min(left, SOCKET_TIMEOUT_S)

    def passed(self) -> Exception:
        from tuf.api.exceptions import SlowRetrievalError

        return SlowRetrievalError(f"{self.url}: not downloaded whole within {self.seconds:g} s (download_timeout_s)")

    def timed_out(self, error: TimeoutError) -> Exception:
        """A read of the socket that waited as long as it was let: past the deadline, or a link gone silent."""
        from tuf.api.exceptions import SlowRetrievalError

        if self.last_wait_was_the_deadline:
            return self.passed()
        return SlowRetrievalError(f"{self.url}: nothing received for {SOCKET_TIMEOUT_S:g} s ({error})")


def _too_long(url: str, max_length: int) -> Exception:
    from tuf.api.exceptions import DownloadLengthMismatchError

    return DownloadLengthMismatchError(f"{url}: more than {max_length} bytes")


class BoundedFetcher(_fetcher_base()):  # type: ignore[misc]
    """A fetcher whose every download ends: whole within ``timeout_s``, or given up; at most ``max_length`` bytes,
    or refused. Subclasses yield a URL's bytes (``_download``), waiting at most until the deadline for each."""

    def __init__(self, *, spool: Path, timeout_s: float = DOWNLOAD_TIMEOUT_S):
        self.spool = spool
        self.timeout_s = timeout_s
        self.received = 0
        """What the last ``download_file`` received: a target refused whole differs from one cut short."""

    def _download(self, url: str, deadline: Deadline, max_length: int | None) -> Generator[bytes, None, None]:
        raise NotImplementedError

    def _fetch(self, url: str) -> Iterator[bytes]:
        return self._download(url, Deadline(url, self.timeout_s), None)

    @contextmanager
    def download_file(self, url: str, max_length: int) -> Iterator[IO[bytes]]:
        """python-tuf's ``download_file`` (every metadata file and target goes through it), with the deadline, and
        its temporary file in ``spool`` rather than ``$TMPDIR``, on the disk the room check measured."""
        deadline = Deadline(url, self.timeout_s)
        self.received = 0
        self.spool.mkdir(parents=True, exist_ok=True)
        chunks = self._download(url, deadline, max_length)
        with tempfile.TemporaryFile(dir=self.spool) as spooled, closing(chunks):
            for chunk in chunks:
                self.received += len(chunk)
                if self.received > max_length:
                    raise _too_long(url, max_length)
                spooled.write(chunk)
                deadline.remaining()
            spooled.seek(0)
            yield spooled


# ---------------------------------------------------------------------------------------------------------------------
# HTTP(S)


class _Socket(socket.socket):
    """A TCP socket whose every read waits at most until its download's deadline."""

    deadline: Deadline | None = None

    def recv_into(self, buffer: WriteableBuffer, nbytes: int = 0, flags: int = 0) -> int:
        if self.deadline is not None:
            self.settimeout(self.deadline.wait())
        return super().recv_into(buffer, nbytes, flags)


class _TLSSocket(ssl.SSLSocket):
    """The same over TLS (``SSLContext.sslsocket_class``); the handshake is bounded by the socket's timeout."""

    deadline: Deadline | None = None

    def recv_into(self, buffer: WriteableBuffer, nbytes: int | None = None, flags: int = 0) -> int:
        if self.deadline is not None:
            self.settimeout(self.deadline.wait())
        return super().recv_into(buffer, nbytes, flags)


class _Connection(http.client.HTTPConnection):
    """One download's connection, to the server or through a proxy, on a socket bounded by ``deadline``."""

    def __init__(self, host: str, port: int, *, deadline: Deadline, tls: ssl.SSLContext | None, server: str):
        super().__init__(host, port, timeout=deadline.wait())
        self.default_port = 443 if tls is not None else 80  # the Host header names a port only when it is another
        self.deadline = deadline
        self.tls = tls
        self.server = server

    def connect(self) -> None:
        super().connect()  # TCP, then a proxy's CONNECT when tunnelling (set_tunnel)
        assert self.sock is not None
        raw = _Socket(fileno=self.sock.detach())
        raw.deadline = self.deadline
        raw.settimeout(self.deadline.wait())
        if self.tls is None:
            self.sock = raw
            return
        sock = self.tls.wrap_socket(raw, server_hostname=self.server)
        if isinstance(sock, _TLSSocket):
            sock.deadline = self.deadline
        self.sock = sock


class HttpFetcher(BoundedFetcher):
    """HTTP(S) on ``http.client`` (python-tuf's own fetcher bounds only the wait for each byte: a byte every few
    seconds kept a check for hours). Certificates are checked against the system's CAs, or ``SSL_CERT_FILE``'s."""

    def __init__(self, *, spool: Path, timeout_s: float = DOWNLOAD_TIMEOUT_S):
        super().__init__(spool=spool, timeout_s=timeout_s)
        self._context: ssl.SSLContext | None = None

    def _tls(self) -> ssl.SSLContext:
        if self._context is None:
            context = ssl.create_default_context()
            context.sslsocket_class = _TLSSocket
            self._context = context
        return self._context

    def _download(self, url: str, deadline: Deadline, max_length: int | None) -> Generator[bytes, None, None]:
        from tuf.api.exceptions import DownloadError

        try:
            with self._get(url, deadline) as response:
                announced = response.getheader("Content-Length", "")
                if max_length is not None and announced.isdigit() and int(announced) > max_length:
                    # a header, not bytes: a proxy's or server's fault, not a verdict on the signed target
                    raise DownloadError(
                        f"{url}: announces {int(announced)} bytes, more than the {max_length} signed (not read; "
                        "tried again at the next check)"
                    )
                while chunk := response.read1(CHUNK):
                    yield chunk
        except TimeoutError as exc:
            raise deadline.timed_out(exc) from exc
        except http.client.HTTPException as exc:
            raise DownloadError(f"{url}: {type(exc).__name__}: {exc}") from exc

    @contextmanager
    def _get(self, url: str, deadline: Deadline) -> Iterator[http.client.HTTPResponse]:
        """The response to GET ``url`` (after redirects), its status 200; closed, with its connection, on leaving."""
        from tuf.api.exceptions import DownloadError, DownloadHTTPError

        for _ in range(MAX_REDIRECTS + 1):
            connection, target, headers = self._connection(url, deadline)
            # Both closed: a response the server ends (HTTP/1.0, "Connection: close") holds the socket on its own.
            with closing(connection):
                try:
                    connection.connect()
                except OSError as exc:  # refused, no route, a name that does not resolve, a certificate not trusted
                    raise DownloadError(f"{url}: cannot connect to {connection.host}:{connection.port}: {exc}") from exc
                connection.request("GET", target, headers={"User-Agent": USER_AGENT, **headers})
                with closing(connection.getresponse()) as response:
                    if response.status == 200:
                        yield response
                        return
                    location = response.getheader("Location")
                    if response.status not in REDIRECTS or not location:
                        raise DownloadHTTPError(f"{url}: HTTP {response.status} {response.reason}", response.status)
            url = urljoin(url, location)
        raise DownloadError(f"{url}: more than {MAX_REDIRECTS} redirects")

    def _connection(self, url: str, deadline: Deadline) -> tuple[_Connection, str, dict[str, str]]:
        """(connection, request target, headers) for ``url``, through the proxy the environment names for it."""
        from tuf.api.exceptions import DownloadError

        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise DownloadError(f"{url}: not an http(s) URL")
        https = parts.scheme == "https"
        port = parts.port or (443 if https else 80)
        tls = self._tls() if https else None
        path = urlunsplit(("", "", parts.path or "/", parts.query, ""))
        proxies = urllib.request.getproxies()
        proxy = proxies.get(parts.scheme) or proxies.get("all")
        if proxy is None or urllib.request.proxy_bypass(parts.hostname):
            return _Connection(parts.hostname, port, deadline=deadline, tls=tls, server=parts.hostname), path, {}
        via = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        if via.scheme != "http" or not via.hostname:
            raise DownloadError(f"{url}: proxy {proxy}: only http:// proxies are supported")
        auth = {}
        if via.username is not None:
            token = base64.b64encode(f"{unquote(via.username)}:{unquote(via.password or '')}".encode()).decode()
            auth["Proxy-Authorization"] = f"Basic {token}"
        connection = _Connection(via.hostname, via.port or 80, deadline=deadline, tls=tls, server=parts.hostname)
        if https:
            connection.set_tunnel(parts.hostname, port, headers=auth)
            return connection, path, {}
        return connection, url, auth  # plain HTTP: the proxy is asked for the whole URL


# ---------------------------------------------------------------------------------------------------------------------
# a directory, file://

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0)


class NotRegularFile(OSError):
    """A path that names a FIFO, a device, a socket or a directory where a file belongs."""


def _regular(path: Path, status: os.stat_result) -> None:
    if not stat.S_ISREG(status.st_mode):
        kind = next((name for test, name in _KINDS if test(status.st_mode)), "not a file")
        raise NotRegularFile(f"{path} is {kind}, not a regular file: not read")


def open_regular(path: Path) -> BinaryIO:
    """``path`` opened for reading when it is a regular file (a symbolic link to one is followed). Anything else is
    refused (``NotRegularFile``) before it is opened (opening a device may act on it: a serial port resets its
    board) and again after, non-blocking (a FIFO swapped in meanwhile), so a reader never waits in ``open``."""
    _regular(path, path.stat())
    descriptor = os.open(path, _OPEN_FLAGS)
    handle = open(descriptor, "rb", buffering=0)  # noqa: SIM115 - returned to the caller, who closes it
    try:
        _regular(path, os.fstat(descriptor))
    except BaseException:
        handle.close()
        raise
    return handle


class LocalFetcher(BoundedFetcher):
    """``file://`` URLs: a repository on a mounted medium. A missing file is a 404, as python-tuf expects from a
    fetcher (it ends the walk along the root chain). Only regular files are read (``open_regular``); a symbolic
    link to one is followed (a repository assembled with links reads like any other: its bytes are checked against
    the signed metadata all the same)."""

    def _download(self, url: str, deadline: Deadline, max_length: int | None) -> Generator[bytes, None, None]:
        from tuf.api.exceptions import DownloadError, DownloadHTTPError

        path = Path(unquote(urlsplit(url).path))
        try:
            handle = open_regular(path)
        except FileNotFoundError as exc:
            raise DownloadHTTPError(f"{path}: not found", 404) from exc
        except NotRegularFile as exc:
            raise DownloadError(str(exc)) from exc
        except OSError as exc:
            raise DownloadHTTPError(f"{path}: {exc.strerror or exc}", 403) from exc
        with handle:
            status = os.fstat(handle.fileno())
            if max_length is not None and status.st_size > max_length:
                raise _too_long(url, max_length)
            while chunk := handle.read(CHUNK):  # the deadline is checked between chunks (download_file)
                yield chunk
