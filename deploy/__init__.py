"""Deployment helpers that ship with the repository: the local process launcher (``python -m deploy.launcher``)."""
