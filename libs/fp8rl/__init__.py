"""fp8rl: GRPO reinforcement learning of LLMs in end-to-end FP8.

Subpackages (lower never imports higher; ``tests/unit/test_import_direction.py`` checks it, and
``docs/ARCHITECTURE.md`` draws it): ``fp8`` ← ``rl``, ``model`` ← ``engines`` ← ``presets`` ←
``controller`` ← ``loop``, with ``data`` and ``limits`` at the bottom; ``refit`` (never engines),
``rpc`` ← ``sdk`` sit beside them for the services.
"""

__version__ = "0.1.0"
