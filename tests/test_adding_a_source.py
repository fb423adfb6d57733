"""Adding an input source is one class registered in one place (docs/adding-an-input-source.md).

A toy source, registered by one entry of ``edgeline.daemon.config.SOURCES`` and nothing else, is a kind the
configuration accepts (and lists among the valid ones), is refused without what it declares it needs, sets the queue's
default policy by what it declares, is made by ``make_source``, and is run by a daemon whose counters and status carry
what the toy counted: no table elsewhere names it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgeline.daemon.config import SOURCES, DaemonConfig, SourceConfig, load_config
from edgeline.daemon.messages import Answer, Message
from edgeline.daemon.service import Daemon
from edgeline.daemon.sources import Source, SourceBase, Submit, make_source
from edgeline.daemon.topics import TopicFilter
from edgeline.errors import EdgelineError

pytestmark = pytest.mark.quick

BUILT_IN = "mqtt, serial, replay, sim, camera"


class CountdownSource(SourceBase):
    """``url = "N"``: N inputs for the tiny LiteRT bundle (64 floats each), then the end (a finite source)."""

    needs = ("url", "how many inputs, e.g. 3")
    json_only = "its own JSON inputs"

    @classmethod
    def lossless(cls, settings: SourceConfig) -> bool:
        return True

    @classmethod
    def from_config(
        cls, settings: SourceConfig, *, filters: Sequence[TopicFilter], max_payload_bytes: int
    ) -> CountdownSource:
        assert settings.url is not None  # the configuration checked ``needs``
        if not settings.url.isdigit():
            raise EdgelineError(f"source.url {settings.url!r}: the countdown source counts, e.g. 3")
        return cls(int(settings.url), device=settings.device or "toy")

    finite = True

    def __init__(self, count: int, *, device: str):
        self.count = count
        self.device = device
        self.description = f"a countdown of {count}"
        self.sent = 0

    def open(self) -> None:
        return None

    def run(self, submit: Submit, stopping: threading.Event) -> None:
        for index in range(self.count):
            if stopping.is_set():
                return
            data = np.random.default_rng(index).random(64, dtype=np.float32).tolist()
            submit(
                Message(topic="toy", payload=json.dumps({"id": f"t{index}", "data": data}).encode(), device=self.device)
            )
            self.sent += 1

    def counters(self) -> dict[str, int]:
        return {"toy_sent": self.sent}

    def status(self) -> dict[str, Any] | None:
        return {"left": self.count - self.sent}


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one place: an entry of ``SOURCES`` (a real source from another folder names its module the same way)."""
    monkeypatch.setitem(SOURCES, "countdown", f"{__name__}:CountdownSource")


def _config(tmp_path: Path, text: str) -> DaemonConfig:
    path = tmp_path / "daemon.toml"
    path.write_text(text, encoding="utf-8")
    return load_config(path)


def test_an_unregistered_kind_is_refused_with_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(EdgelineError, match=rf"source\.kind: 'countdown' is not valid; valid: {BUILT_IN}$"):
        _config(tmp_path, "[source]\nkind = 'countdown'\nurl = '3'\n")


@pytest.mark.usefixtures("registered")
def test_a_registered_source_is_validated_by_what_its_class_declares(tmp_path: Path) -> None:
    config = _config(tmp_path, "[source]\nkind = 'countdown'\nurl = '3'\n")
    assert (config.source.kind, config.queue_policy, config.uses_broker) == ("countdown", "block", False)
    with pytest.raises(EdgelineError, match=r"source: value error, the countdown source needs source\.url: how many"):
        _config(tmp_path, "[source]\nkind = 'countdown'\n")
    with pytest.raises(EdgelineError, match=r"input\.codec = 'cbor': the countdown source hands the daemon JSON \("):
        _config(tmp_path, "[source]\nkind = 'countdown'\nurl = '3'\n[input]\ncodec = 'cbor'\n")
    with pytest.raises(EdgelineError, match=rf"source\.kind: 'usb' is not valid; valid: {BUILT_IN}, countdown$"):
        _config(tmp_path, "[source]\nkind = 'usb'\n")


@pytest.mark.usefixtures("registered")
def test_make_source_makes_a_registered_source_from_its_settings(tmp_path: Path) -> None:
    config = _config(tmp_path, "[source]\nkind = 'countdown'\nurl = '4'\ndevice = 'bench'\n")
    made: Source | None = make_source(config.source, filters=[], max_payload_bytes=1024)
    assert isinstance(made, CountdownSource)
    assert (made.count, made.device) == (4, "bench")
    bad = config.with_overrides(source={"url": "four"})
    with pytest.raises(EdgelineError, match=r"source\.url 'four': the countdown source counts"):
        make_source(bad.source, filters=[], max_payload_bytes=1024)


@pytest.mark.usefixtures("registered")
def test_a_daemon_runs_a_registered_source_and_reports_what_it_counted(
    built_litert_bundle: Path, tmp_path: Path
) -> None:
    config = _config(
        tmp_path, f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[source]\nkind = 'countdown'\nurl = '3'\n"
    )
    answers: list[Answer] = []
    daemon = Daemon(built_litert_bundle, config, echo=answers.append)
    assert isinstance(daemon.source, CountdownSource)  # made from the configuration, not handed in
    assert daemon.run_until_signalled() == 0  # a finite source: drained, then a clean exit
    assert sorted(answer.record["id"] for answer in answers) == ["t0", "t1", "t2"]
    assert all("outputs" in answer.record for answer in answers), [a.record for a in answers]
    assert daemon.reporter.counters()["toy_sent"] == 3
    status = daemon.reporter.status()
    assert status["source"] == {"left": 0}
    assert status["queue_policy"] == "block"
