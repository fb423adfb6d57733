"""The error tree of edgeline. Its root lives here, in the lowest folder, so every other folder can use it; a
subclass that only one module raises lives beside it, named in brackets.

    EdgelineError              a user's mistake or an environment problem: exit code 2, one clear line
    ├── ProfileError           unknown profile id, broken profile file, invalid field
    ├── BundleError            a bundle that cannot be read: missing files, bad manifest
    │   └── IntegrityError     a file whose size or sha256 differs from the manifest
    ├── BackendUnavailableError  a backend whose optional dependency is not installed (names the extra)
    ├── PayloadError           model inputs of the wrong count, shape, dtype, or with NaN/Inf
    ├── UpdateError            a signed update that cannot be published or fetched (keys, repository, link)
    │   └── UpdateRefused      an update the device will not take: ``reason`` is one of ``REFUSAL_REASONS``
    ├── CameraError            a camera or video that cannot be opened or read: ``reason`` in ``CAMERA_REASONS``
    ├── KeysError              [edgeline.updates.keys] a keys directory missing, incomplete, untrusted, open to others
    ├── WriteRefused           [edgeline.durable] a write through a link, or over what edgeline did not make
    ├── BrokerRefused          [edgeline.daemon.mqtt] the broker could not be reached or refused us at start
    ├── DiskFull               [edgeline.daemon.outbox] an outbox write failed for lack of space
    ├── OutboxClosed           [edgeline.daemon.outbox] a call after ``close``
    │   └── OutboxLost         its files deleted or truncated under it, and no new outbox could be made there
    ├── FrameError             [edgeline.firmware_bridge.protocol] a frame refused
    ├── FleetError             [edgeline.sim.fleet_status] a simulated fleet that cannot be made or observed
    ├── WriteLogError          [edgeline.sim.writelog] a block write log cut short or not one
    ├── MqttStreamError        [edgeline.sim.mqtt_tap] bytes through the power-cut tap that are not MQTT
    ├── SceneError             [edgeline.sim.scene] a synthetic scene of a size, rate or count out of range
    └── ExportError            [edgeline.export.errors] export failed for a reason the user can act on
        ├── ModelLoadError     MODEL could not be imported, called, or did not give a torch.nn.Module
        ├── CalibrationError   sample files that do not match the model
        ├── TraceError         torch.export, every target's first step, cannot capture the model (names its line)
        ├── LoweringError      a backend could not convert the model (names the operator when it can)
        └── BudgetError        no target met the profile's budgets

``__all__`` below is the one list of the names defined here: ``edgeline.errors`` re-exports exactly those (import
them from there), and ``tests/test_one_place.py`` holds every other table that names one of them (``edgeline``'s and
``edgeline.device_profiles``' names loaded on first use) to it.
Anything that is not an ``EdgelineError`` reaching the command line is a bug of ours.
"""

from __future__ import annotations

__all__ = [
    "CAMERA_REASONS",
    "DAEMON_CODES",
    "PAYLOAD_CODES",
    "REFUSAL_REASONS",
    "BackendUnavailableError",
    "BundleError",
    "CameraError",
    "EdgelineError",
    "IntegrityError",
    "PayloadError",
    "ProfileError",
    "UpdateError",
    "UpdateRefused",
]


class EdgelineError(Exception):
    """Root of every error edgeline raises on purpose."""

    exit_code = 2


class ProfileError(EdgelineError):
    """A device profile that does not exist or does not validate."""


class BundleError(EdgelineError):
    """A bundle that cannot be used: missing files, unreadable or invalid manifest."""


class IntegrityError(BundleError):
    """A bundle file whose size or hash does not match its manifest."""


class BackendUnavailableError(EdgelineError):
    """A backend that needs an optional dependency that is not installed."""


class PayloadError(EdgelineError):
    """Inputs that do not match what the model expects.

    ``code`` is the machine-readable reason the daemon puts in its error answers; one of ``PAYLOAD_CODES``.
    """

    def __init__(self, message: str, *, code: str = "invalid-input"):
        super().__init__(message)
        if code not in PAYLOAD_CODES:
            raise ValueError(f"unknown payload error code {code!r}; valid: {', '.join(PAYLOAD_CODES)}")
        self.code = code


DAEMON_CODES = (
    "dropped",  # the queue was full (policy drop-oldest): the input was never run
    "inference-failed",  # the runtime failed on a valid input (a bug or a broken model; logged)
    "invalid-topic",  # the answer's topic cannot be formed from the message's device (wildcards, over 64 KiB)
)
"""The codes of ``PAYLOAD_CODES`` that are not about the payload itself, but answered the same way by the daemon."""
PAYLOAD_CODES = (
    # a field that no code below covers: an id that is neither text nor an integer, an input given twice
    "invalid-input",
    "malformed",  # the payload cannot be parsed by its codec
    "oversized",  # larger than the configured limit (checked before decoding)
    "missing-input",  # a model input is absent from the message
    "wrong-shape",  # element count or shape does not fit the model input
    "wrong-dtype",  # values of a type that is not a real number
    "non-finite",  # NaN or Inf
    *DAEMON_CODES,
)
"""Every code an error answer can carry (``{"id", "error": {"code", "message"}}``): the one list. The daemon, the
README's list (held equal by ``tests/test_docs.py``) and the tests take it from here."""


class UpdateError(EdgelineError):
    """An update that cannot be published or fetched: keys, repository, or the link to it."""


REFUSAL_REASONS = (
    "bad-signature",  # unsigned, or signed by a key the pinned root does not trust
    "tampered",  # a file whose length or hashes differ from its signed metadata
    "rollback",  # metadata older than what the device has already seen (a replayed repository)
    "downgrade",  # a bundle older than the one that runs
    "expired",  # metadata past its expiry
    "incompatible",  # another profile, another name, a runtime this device lacks, other inputs
    "malformed",  # signed and intact, yet not a bundle this runtime can read
    "self-test",  # the bundle's golden self-test failed here
    "trial",  # its trial beside the previous version did not meet the gates
    "revoked",  # the publisher withdrew it (a halted rollout)
    "no-room",  # not now: the state directory's disk or the memory a trial needs (tried again at the next check)
    "timeout",  # a download not whole within download_timeout_s: given up, tried again at the next check
    "crashed",  # opened in its cage (a child process), the runtime crashed: a signal, or an exit without a verdict
    "hung",  # opened in its cage, it did not load and answer its golden inputs within [updates] open_timeout_s
    "too-big",  # opened in its cage, it took more memory than it may (the cage's cap, or the unit's MemoryMax)
)


class UpdateRefused(UpdateError):
    """An update the device refuses; ``reason`` (one of ``REFUSAL_REASONS``) labels its counter."""

    def __init__(self, message: str, *, reason: str, version: int | None = None):
        super().__init__(message)
        if reason not in REFUSAL_REASONS:
            raise ValueError(f"unknown refusal reason {reason!r}; valid: {', '.join(REFUSAL_REASONS)}")
        self.reason = reason
        self.version = version


CAMERA_REASONS = (
    "unreachable",  # the source cannot be opened: connection refused, an HTTP error, no such file or device
    "timeout",  # no answer within the open deadline, or no frame within the read deadline
    "not-a-video",  # a file (or a folder of images) that holds no decodable video
    "corrupt",  # too many undecodable packets in a row: the stream is given up
    "ended",  # a live stream that ended (the server closed it)
    "unsupported",  # a source text of no known form, or options it does not take
    "missing-extra",  # the library the source needs is not installed (the camera extra, picamera2)
)


class CameraError(EdgelineError):
    """A camera or video that cannot be opened or read (``edgeline.video``). ``reason`` is one of
    ``CAMERA_REASONS``; the text never carries a URL's credentials."""

    def __init__(self, message: str, *, reason: str):
        super().__init__(message)
        if reason not in CAMERA_REASONS:
            raise ValueError(f"unknown camera error reason {reason!r}; valid: {', '.join(CAMERA_REASONS)}")
        self.reason = reason
