"""The streaming half of edgeline: ``edgeline run`` and what it is made of.

    source (mqtt, serial, replay, sim) → codec → window → bounded queue → worker (Processor) → outbox → sinks

Importing this package imports nothing; each module is imported by whoever needs it. The library half (bundle,
model, backends) never imports from here.
"""
