"""``python -m fp8rl.config``: print the job file reference (every key, its default and docstring)."""

from fp8rl.config import reference

print(reference(), end="")
