"""Whether a trainer checkpoint resumes on this trainer: the training it was written by — the same linears' format,
and LoRA adapters on the same base with the same settings, or every weight. Both the ``.pt`` file and the ``.dcp``
directory record what is checked (the trainer's model record)."""

from __future__ import annotations

__all__ = ["check_resumable"]


def check_resumable(path: str, linear: str | None, lora: dict | None, *, recipe_linear: str,
                    model_record: dict) -> None:
    """Refuse checkpoint ``path`` (its recorded ``linear`` format and ``lora`` record) on a trainer of
    ``recipe_linear`` linears whose own record is ``model_record``.

    Raises:
        ValueError: naming what differs (the linears' format, LoRA on one side only, other adapter settings,
            another base).
    """
    if linear != recipe_linear:
        raise ValueError(f"{path} was trained with {linear} linears, this trainer uses {recipe_linear}")
    mine = model_record.get("lora")
    if (lora is None) != (mine is None):
        has = "LoRA adapters" if lora is not None else "every weight (no LoRA)"
        wants = "LoRA adapters (policy.lora.enabled=true)" if mine is not None else "every weight"
        raise ValueError(f"{path} holds {has}, this trainer trains {wants}")
    if lora is None:
        return
    if not isinstance(lora, dict):
        raise ValueError(f"{path}: its lora record is not a mapping: {lora!r:.200}")
    if lora.get("base_checksum") != mine["base_checksum"]:
        raise ValueError(f"{path} holds LoRA adapters of another base model (base checksum "
                         f"{lora.get('base_checksum')!r}, trained on {model_record['model_source']!r}); "
                         f"this trainer's base is {mine['base_checksum']!r}: resume on the base the adapters "
                         "were trained on (policy.model)")
    for key in ("rank", "alpha", "target_modules", "share_experts"):
        if lora.get(key, False) != mine.get(key, False):
            raise ValueError(f"{path} holds adapters with policy.lora.{key}={lora.get(key, False)!r}, this "
                             f"trainer uses {mine.get(key, False)!r}")
