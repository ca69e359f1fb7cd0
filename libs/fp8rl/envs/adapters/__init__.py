"""Environments of the ecosystem run as fp8rl environments, one adapter per file, each importing its package only
when an environment is made (they are optional): :mod:`.skyrl` (SkyRL-Gym text environments), :mod:`.gym`
(gymnasium environments whose observations and actions are text), :mod:`.openenv` (OpenEnv's ``Environment``
classes, in-process), :mod:`.trl` (a TRL ``environment_factory`` class: its public methods are the tools)."""

from . import gym, openenv, skyrl, trl

__all__ = ["gym", "openenv", "skyrl", "trl"]
