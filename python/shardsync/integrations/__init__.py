"""Weight-sync handlers for RL frameworks, built on shardsync sessions and engine hooks.

- `unirl`: `ShardsyncWeightSync`, a UniRL full-weight sync handler (`FullWeightSync`).

Each module imports its framework when imported; nothing here is imported by `shardsync`.
"""
