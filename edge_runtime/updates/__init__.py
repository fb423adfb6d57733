"""Updates a fleet can trust: bundles published as signed TUF targets, fetched and checked on the device, swapped in
between two messages, tried beside the previous version, committed or rolled back, and rolled out in waves.

    keys        ``edgeline keys generate``: the four roles' ed25519 keys and the root metadata devices pin
    archive     a bundle packed as one tar, and its careful unpacking (nothing outside the manifest's list)
    repository  ``edgeline publish``: the TUF repository a workstation or gateway writes
    served      what a repository serves, read as a device would before a publisher writes: it signs only what it wrote
    highwater   what the keys signed, by repository (KEYS/signed.json): a replayed older state is refused
    lock        one writer of a repository (and of a keys directory) at a time, and who it is
    client      the device's side: TUF's Updater over a directory, ``file://`` or HTTP(S); every refusal coded
    fetchers    every download whole within its deadline and no longer than signed, spooled on the state's disk
    policy      what the device takes: compatibility, audience, downgrade, the trial's gates
    agent       the daemon's update thread: found → verified → self-test → swap → trial → committed | rolled back
    rollout     ``edgeline rollout``: canary, waves, halt (at a gateway beside the broker)

Nothing here imports torch; the device's side needs python-tuf and cryptography only.
"""
