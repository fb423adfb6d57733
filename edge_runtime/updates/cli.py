"""``edgeline keys generate|renew|rotate``, ``edgeline publish`` and ``edgeline rollout``: signing bundles for a fleet.

Registering imports nothing heavy: python-tuf loads when a command runs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from edgeline.arguments import bounded_int

__all__ = ["register"]


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is out of range; valid: 0 to 1")
    return value


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def register(subparsers: Any) -> None:
    keys = subparsers.add_parser(
        "keys",
        help="signing keys for updates",
        description="Signing keys for a repository of updates (TUF roles: root, targets, snapshot, timestamp).",
    )
    actions = keys.add_subparsers(dest="keys_action", metavar="ACTION", required=True)
    generate = actions.add_parser(
        "generate",
        help="create the four ed25519 keys and DIR/root.json, the root metadata devices pin",
        description=(
            "Create one ed25519 key per TUF role in DIR (root.key, targets.key, snapshot.key, timestamp.key; "
            "owner-readable only) and DIR/root.json, the signed root metadata every device pins with "
            "--trusted-root. Keep root.key offline: only a new root (key rotation, yearly renewal) needs it. "
            "Set EDGELINE_KEY_PASSPHRASE to write (and later read) the keys encrypted."
        ),
    )
    generate.add_argument("directory", metavar="DIR", type=Path, help="where the keys and root.json go")
    generate.add_argument(
        "--force", action="store_true", help="replace existing keys (every device must then be re-provisioned)"
    )
    generate.set_defaults(func=_generate)
    renew = actions.add_parser(
        "renew",
        help="sign the next root version with a new expiry date (yearly, with the offline root key)",
        description=(
            "Write DIR/N.root.json and DIR/root.json: the next version of the root metadata, the same keys, a new "
            "expiry, signed with root.key. Devices keep the root they pinned and walk the chain to it. With --repo "
            "the repository is re-signed at once so devices see it; otherwise run `edgeline publish --refresh`."
        ),
    )
    rotate = actions.add_parser(
        "rotate",
        help="replace one role's key (a lost or exposed key) in a new root version",
        description=(
            "Replace ROLE's key with a new one (ROLE.key; the old key is deleted) and write the next root version, "
            "which trusts only the new key, signed with the root key the current root trusts (rotating root: with "
            "both the old and the new root key). Devices walk the chain from the root they pinned: nothing is "
            "re-provisioned, and from then on they refuse what the old key signs. With --repo the repository is "
            "re-signed with the new keys at once; otherwise run `edgeline publish --refresh`."
        ),
    )
    rotate.add_argument("directory", metavar="DIR", type=Path, help="the keys directory")
    rotate.add_argument("role", metavar="ROLE", choices=("root", "targets", "snapshot", "timestamp"),
                        help="root, targets, snapshot or timestamp")  # fmt: skip
    renew.add_argument("directory", metavar="DIR", type=Path, help="the keys directory")
    for action in (renew, rotate):
        action.add_argument(
            "--expires-days", metavar="N", type=_positive, default=None, help="days until the new root expires (365)"
        )
        action.add_argument("--repo", metavar="REPO", type=Path, help="re-sign this repository with the new root")
    renew.set_defaults(func=_new_root, role=None)
    rotate.set_defaults(func=_new_root)

    publish = subparsers.add_parser(
        "publish",
        help="sign a bundle into an update repository",
        description=(
            "Add BUNDLE, packed as one archive, to the TUF repository REPO as a signed target whose metadata "
            "carries what a device checks before fetching it (name, version, profile, backend, runtime, the "
            "manifest's sha256, the trial's gates), then sign new targets, snapshot and timestamp metadata. "
            "REPO is a directory: serve it over HTTP(S), rsync it or copy it to a USB stick. Without BUNDLE, "
            "--refresh re-signs the current state with new expiry dates, and --remove NAME VERSION removes a "
            "target from the signed metadata (one whose archive is lost). One command writes a repository at a "
            "time (REPO/.edgeline.lock; another waits up to 60 s, then is told who holds it), and a repository "
            "below what these keys signed for it (KEYS/signed.json: an older state put back) is refused."
        ),
    )
    publish.add_argument("bundle", metavar="BUNDLE", type=Path, nargs="?", help="a bundle directory (edgeline export)")
    publish.add_argument(
        "--repo", metavar="REPO", type=Path, required=True, help="the repository directory (created if new)"
    )
    publish.add_argument(
        "--keys", metavar="DIR", type=Path, required=True, help="the keys directory (edgeline keys generate)"
    )
    publish.add_argument(
        "--expires-days", metavar="N", type=_positive, default=None,
        help="days until the timestamp metadata expires (default 30; targets and snapshot: 365 or N if longer)",
    )  # fmt: skip
    publish.add_argument("--refresh", action="store_true", help="re-sign the current state (no BUNDLE)")
    publish.add_argument(
        "--remove", metavar=("NAME", "VERSION"), nargs=2, default=None,
        help="remove the target NAME VERSION from the signed metadata, and its archive if it is there (no BUNDLE): "
        "a target whose archive is lost blocks every write until then; devices that run it keep it (this is not a "
        "revocation)",
    )  # fmt: skip
    publish.add_argument(
        "--devices", metavar="ID,ID", default=None,
        help="offer the bundle to these device instance ids only (default: every device; `edgeline rollout` widens it)",
    )  # fmt: skip
    publish.add_argument(
        "--hold", action="store_true",
        help="offer the bundle to no device yet: `edgeline rollout NAME VERSION` takes it to the fleet in waves",
    )  # fmt: skip
    gates = publish.add_argument_group("trial gates (checked on each device before the new version is committed)")
    gates.add_argument(
        "--trial-inputs", metavar="N", type=bounded_int(1, 1_000_000), help="inputs in the trial (default 200)"
    )
    gates.add_argument("--trial-seconds", metavar="S", type=_positive, help="longest trial, in seconds (default 600)")
    gates.add_argument(
        "--min-agreement",
        metavar="F",
        type=_fraction,
        help="share of inputs answered as the previous version did (default 0.90)",
    )
    gates.add_argument(
        "--max-error-rate",
        metavar="F",
        type=_fraction,
        help="share of inputs the new version may fail where the previous answered (default 0.01)",
    )
    gates.add_argument(
        "--tolerance",
        metavar="F",
        type=_positive,
        help="non-classifiers: relative difference that still agrees (default 0.1)",
    )
    gates.add_argument(
        "--max-latency-ms",
        metavar="MS",
        type=_positive,
        help="p95 model latency on the device (default: the profile's budget)",
    )
    publish.add_argument("--json", action="store_true", help="print what was published as one JSON document")
    publish.set_defaults(func=_publish)

    rollout = subparsers.add_parser(
        "rollout",
        help="take a published version to a fleet in waves, halting by itself on a regression",
        description=(
            "Offer NAME VERSION (published with --hold) to the fleet's canary devices first, watch their status "
            "topics (swap outcome, error rate, anomaly rate, latency), then widen in waves twice the size of what "
            "came before. A wave whose failure rate exceeds --max-failure-rate halts the rollout: the version is "
            "revoked in the signed metadata, the devices that took it go back to their previous version, and the "
            "rest never fetch it. Runs at a gateway beside the broker; exit 1 when halted."
        ),
    )
    rollout.add_argument("name", metavar="NAME", help="the bundle name")
    rollout.add_argument("version", metavar="VERSION", type=bounded_int(1), help="the version to roll out")
    rollout.add_argument("--repo", metavar="REPO", type=Path, required=True, help="the repository directory")
    rollout.add_argument("--keys", metavar="DIR", type=Path, required=True, help="the keys directory")
    rollout.add_argument("--fleet", metavar="FLEET.toml", type=Path, required=True, help="the devices and their broker")
    rollout.add_argument(
        "--canary", metavar="K", type=bounded_int(1), default=1, help="devices in the first wave (default 1)"
    )
    rollout.add_argument(
        "--max-failure-rate", metavar="R", type=_fraction, default=0.1,
        help="share of a wave's devices that may fail before the rollout halts (default 0.1)",
    )  # fmt: skip
    rollout.add_argument(
        "--wave-timeout", metavar="S", type=_positive, default=900.0, help="seconds for a wave's outcomes (default 900)"
    )
    rollout.add_argument(
        "--soak",
        metavar="S",
        type=float,
        default=60.0,
        help="seconds a wave's devices are watched after they commit (default 60)",
    )
    rollout.add_argument(
        "--silent-after", metavar="S", type=_positive, default=60.0,
        help="a device of the wave whose status is older than this fails (default 60; keep it above the daemons' "
        "[health] status_interval_s)",
    )  # fmt: skip
    rollout.add_argument("--json", action="store_true", help="print the outcome as one JSON document at the end")
    rollout.set_defaults(func=_rollout)


def _rollout(args: argparse.Namespace) -> int:
    from edgeline.errors import UpdateError
    from edgeline.updates.repository import Repository
    from edgeline.updates.rollout import Rollout, RolloutOptions, load_fleet

    fleet = load_fleet(args.fleet)
    if fleet.name is not None and fleet.name != args.name:
        raise UpdateError(f"{args.fleet} is the fleet of {fleet.name!r}, not {args.name!r}")
    if args.soak < 0:
        raise UpdateError("--soak: seconds, 0 or more")
    options = RolloutOptions(
        canary=args.canary, max_failure_rate=args.max_failure_rate, wave_timeout_s=args.wave_timeout,
        soak_s=args.soak, stale_after_s=args.silent_after,
    )  # fmt: skip
    rollout = Rollout(Repository(args.repo, args.keys), fleet, args.name, args.version, options)
    done = rollout.run()
    if args.json:
        print(json.dumps({"name": args.name, "version": args.version, "completed": done, "halted": rollout.halted,
                          "stopped": rollout.stopped, "devices": [o.as_dict() for o in rollout.outcomes.values()]},
                         indent=2))  # fmt: skip
    return 0 if done else 1


def _generate(args: argparse.Namespace) -> int:
    from edgeline.updates.keys import generate

    root = generate(args.directory, force=args.force)
    print(f"wrote the root, targets, snapshot and timestamp keys and {root}")
    print(f"devices pin {root}: edgeline run BUNDLE --updates REPO --trusted-root root.json")
    print(f"keep {args.directory / 'root.key'} offline; publishing needs the other three")
    return 0


def _new_root(args: argparse.Namespace) -> int:
    from edgeline.updates.keys import ROOT_EXPIRY_DAYS, new_root
    from edgeline.updates.repository import Repository

    days = args.expires_days if args.expires_days is not None else ROOT_EXPIRY_DAYS
    if args.repo is None:
        made = new_root(args.directory, rotate=args.role, expires_days=days)
    else:
        repository = Repository(args.repo, args.directory)
        with repository.writing():  # no other writer between the check, the new root and the re-signing
            repository.check()  # before the new root is written: a repository these keys did not sign changes nothing
            made = new_root(args.directory, rotate=args.role, expires_days=days)
            version = repository.refresh()
    what = f"a new {made.rotated} key, " if made.rotated else "the same keys, "
    print(f"wrote root version {made.version} ({what}expires {made.expires:%Y-%m-%d %H:%M} UTC): {made.path}")
    if args.repo is not None:
        print(f"re-signed {args.repo} (targets version {version}): devices take root v{made.version} at next check")
    else:
        print(f"devices see it once the repository is re-signed: edgeline publish --refresh --keys {args.directory} "
              "--repo REPO")  # fmt: skip
    print("devices keep the root.json they pinned: they walk the chain from it")
    return 0


def _publish(args: argparse.Namespace) -> int:
    from edgeline.errors import UpdateError
    from edgeline.updates.policy import Gates
    from edgeline.updates.repository import Repository

    repository = Repository(args.repo, args.keys)
    if args.remove is not None:
        return _remove(args, repository)
    if args.bundle is None:
        if not args.refresh:
            raise UpdateError(
                "give a BUNDLE to publish, --refresh to re-sign the current state, or --remove NAME VERSION"
            )
        version = repository.refresh(expires_days=args.expires_days)
        print(f"re-signed {args.repo} (targets version {version})")
        return 0
    if args.refresh:
        raise UpdateError("--refresh re-signs without a bundle; give one or the other")
    chosen = {
        "inputs": args.trial_inputs, "seconds": args.trial_seconds, "min_agreement": args.min_agreement,
        "max_error_rate": args.max_error_rate, "tolerance": args.tolerance, "max_latency_ms": args.max_latency_ms,
    }  # fmt: skip
    gates = Gates(**{k: v for k, v in chosen.items() if v is not None})
    if args.hold and args.devices is not None:
        raise UpdateError("--hold offers the bundle to no device; --devices to some: give one or the other")
    audience = tuple(d.strip() for d in args.devices.split(",") if d.strip()) if args.devices is not None else None
    if args.hold:
        audience = ()
    published = repository.publish(args.bundle, gates=gates, audience=audience, expires_days=args.expires_days)
    facts = published.facts
    if args.json:
        document = {"path": published.path, "archive": str(published.archive), "length": published.length}
        document.update(targets_version=published.targets_version, **facts.model_dump(mode="json"))
        print(json.dumps(document, indent=2))
        return 0
    who = "every device" if facts.audience is None else f"{len(facts.audience)} device(s)"
    if facts.audience == ():
        who = "no device yet (held for `edgeline rollout`)"
    print(
        f"published {facts.name} v{facts.version} ({facts.profile}, {facts.backend} {facts.precision}) as "
        f"{published.path}: {published.length} bytes, offered to {who}; targets metadata v{published.targets_version}"
    )
    g = facts.trial
    latency = f"{g.max_latency_ms} ms" if g.max_latency_ms else "the profile's budget"
    print(
        f"trial on each device: {g.inputs} inputs or {g.seconds:g} s, errors <= {g.max_error_rate:.1%}, "
        f"agreement >= {g.min_agreement:.0%}, p95 latency <= {latency}"
    )
    return 0


def _remove(args: argparse.Namespace, repository: Any) -> int:
    from edgeline.errors import UpdateError

    given = [flag for flag, value in (("BUNDLE", args.bundle), ("--refresh", args.refresh), ("--hold", args.hold),
                                      ("--devices", args.devices)) if value]  # fmt: skip
    given += [f"--{name.replace('_', '-')}" for name in _GATES if getattr(args, name) is not None]
    if given:
        raise UpdateError(f"--remove NAME VERSION is a command of its own: {', '.join(given)} cannot go with it")
    name, text = args.remove
    try:
        version = int(text)
    except ValueError:
        raise UpdateError(f"--remove {name} {text}: VERSION is a whole number, 1 or more") from None
    if version < 1:
        raise UpdateError(f"--remove {name} {text}: VERSION is a whole number, 1 or more")
    removed = repository.remove(name, version, expires_days=args.expires_days)
    archive = "deleted" if removed.archive_was_there else "already missing"
    if args.json:
        document = {"removed": removed.path, "archive": str(removed.archive)}
        document.update(archive_was_there=removed.archive_was_there, targets_version=removed.targets_version)
        print(json.dumps(document, indent=2))
        return 0
    print(
        f"removed {name} v{version} ({removed.path}) from the signed metadata of {args.repo} (targets metadata "
        f"v{removed.targets_version}); its archive {removed.archive.name} was {archive}"
    )
    print("devices no longer see it; a device that runs it keeps it (to take it back, publish a newer version)")
    return 0


_GATES = ("trial_inputs", "trial_seconds", "min_agreement", "max_error_rate", "tolerance", "max_latency_ms")
