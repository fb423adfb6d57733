"""A toy export target and the toy runtime backend that runs its bundles: what a newcomer writes to add a target
(docs/adding-an-export-target.md, docs/adding-a-runtime-backend.md). ``tests/test_toy_target.py`` registers both."""
