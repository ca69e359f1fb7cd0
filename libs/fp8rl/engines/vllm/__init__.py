"""The vLLM rollout engine (an optional install: ``.venv-vllm``, the GPU image).

* :mod:`.rollout` — :class:`~.rollout.VllmRolloutEngine`, a :class:`~fp8rl.engines.RolloutEngine` over ``vllm.LLM``.
* :mod:`.launch` — how a recipe maps onto vLLM's options, and the FP8 hardware check.
* :mod:`.worker` — the worker extension that loads refitted weights inside vLLM's worker process.

Nothing here is imported by ``fp8rl.engines`` itself: importing this package needs no vLLM, using it does.
"""
