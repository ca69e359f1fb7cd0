"""fp8rl: GRPO reinforcement learning of LLMs in end-to-end FP8.

Subpackages (lower never imports higher): ``fp8`` ← ``rl``, ``model``, ``data`` ← ``engines`` ←
``loop``; ``refit``, ``rpc`` and ``sdk`` sit beside them for the services.
"""

__version__ = "0.1.0"
