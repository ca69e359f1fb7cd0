"""The plug-in registries (issue 49): model families and FP8 formats, and nothing outside them branches on a name.

A *listing* of a name is a comparison with it (``arch == "qwen2"``, ``scaling in (...)``) or a collection literal
holding it (a tuple, list, set or dict key). Outside ``fp8rl/model/families/`` (families) and ``fp8rl/fp8/formats/``
(formats) there must be none in ``libs/``, ``services/`` and ``bench/``: the code asks the family (``config.family``)
or the format (``recipe.format``, :func:`~fp8rl.fp8.linear_format`) instead. Naming the architecture a preset builds
(``ModelConfig(architecture="llama", ...)``) or a default argument is data, not a listing.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from fp8rl.fp8 import LinearFormat, format_names, linear_format
from fp8rl.fp8.formats import register as register_format
from fp8rl.model import CausalLM, ModelConfig
from fp8rl.model.family import Family, family_names, get_family, register

REPO = Path(__file__).resolve().parents[2]
FAMILIES_DIR = REPO / "libs" / "fp8rl" / "model" / "families"
FORMATS_DIR = REPO / "libs" / "fp8rl" / "fp8" / "formats"
# file -> why its one listing is not about fp8rl's families
ALLOWED = {"libs/fp8rl/presets/smollm2.py": "GGUF's general.architecture of the file it converts ('llama')"}


def listings(tree: ast.AST, names: set[str]) -> list[int]:
    """Line numbers where ``tree`` compares with a family name or lists one in a collection literal."""
    def named(node) -> bool:
        return isinstance(node, ast.Constant) and node.value in names

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(named(n) for n in [node.left, *node.comparators]):
            lines.append(node.lineno)
        elif isinstance(node, ast.Tuple | ast.List | ast.Set) and any(named(e) for e in node.elts):
            lines.append(node.lineno)
        elif isinstance(node, ast.Dict) and any(named(k) for k in node.keys if k is not None):
            lines.append(node.lineno)
    return lines


def _listed_outside(home: Path, names: set[str]) -> dict[str, list[int]]:
    found = {}
    for path in (p for d in ("libs", "services", "bench") for p in (REPO / d).rglob("*.py")):
        if home in path.parents:
            continue
        rel = str(path.relative_to(REPO))
        lines = listings(ast.parse(path.read_text()), names)
        if lines and rel not in ALLOWED:
            found[rel] = lines
    return found


def test_the_registry_is_the_only_place_a_family_is_listed():
    found = _listed_outside(FAMILIES_DIR, set(family_names()))
    assert not found, f"family names listed outside fp8rl/model/families (ask config.family instead): {found}"


def test_the_registry_is_the_only_place_a_format_is_listed():
    found = _listed_outside(FORMATS_DIR, set(format_names()))
    assert not found, f"format names listed outside fp8rl/fp8/formats (ask the format instead): {found}"


def test_the_scanner_finds_a_listing():
    names = {"qwen2", "llama"}
    tree = ast.parse('a = arch == "qwen2"\nb = ("llama", 3)\nc = {"qwen2": 1}\nd = f(architecture="llama")\n')
    assert listings(tree, names) == [1, 2, 3]


def test_every_family_builds_and_round_trips_its_config_json():
    assert {"llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"} <= set(family_names())
    for name in family_names():
        fam = get_family(name)
        assert fam.name == name and fam.hf_class.endswith("ForConditionalGeneration" if fam.vision else "ForCausalLM")
        assert all(fam.refusal(e) is None or isinstance(fam.refusal(e), str) for e in ("torch", "vllm", "megatron"))
        # a vision-language family's own keys (a flat, pre-4.52 file: the text keys at the top level)
        vision = {"vision_config": {"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 16,
                                    "out_hidden_size": 64, "num_position_embeddings": 16}, "image_token_id": 60,
                  "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]}} if fam.vision else {}
        cfg = ModelConfig.from_hf_dict({"model_type": name, "vocab_size": 64, "hidden_size": 64,
                                        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                                        "head_dim": 32, "n_routed_experts": 4, "num_experts": 4,
                                        "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
                                        "moe_intermediate_size": 32, "kv_lora_rank": 16, "q_lora_rank": None,
                                        "qk_nope_head_dim": 16, "qk_rope_head_dim": 32, "v_head_dim": 16, **vision})
        assert type(cfg) is (fam.config_class or ModelConfig) and cfg.family is fam
        again = ModelConfig.from_hf_dict(cfg.to_hf_dict())
        assert again == cfg, name
        CausalLM(cfg)  # builds


def test_registry_errors_are_clear():
    with pytest.raises(ValueError, match=r"unsupported architecture 'mamba'; supported: \['deepseek_v3'"):
        get_family("mamba")
    with pytest.raises(ValueError, match="unknown engine 'tpu'"):
        get_family("llama").refusal("tpu")

    class Other(Family):
        name, hf_class = "llama", "OtherForCausalLM"

    with pytest.raises(ValueError, match="model family 'llama' is registered twice"):
        register(Other())
    with pytest.raises(ValueError, match="needs a name and an hf_class"):
        register(Family())


def test_every_format_answers_the_registry_questions():
    assert format_names()[0] == "blockwise"  # the default first
    for name in format_names():
        fmt = linear_format(name)
        assert fmt.name == name and fmt.label and fmt.summary
        assert fmt.refusal("torch") is None  # the embedded engines run every format
        q, s = fmt.quantize_weight(torch.randn(256, 128))
        assert tuple(s.shape) == fmt.scale_shape(256, 128) and s.dtype == fmt.scale_dtype
        fmt.check_scale(name, s, (256, 128))
    assert linear_format("tensorwise").refusal("megatron", tensor_parallel=2)
    assert linear_format("tensorwise").refusal("megatron") is None
    with pytest.raises(ValueError, match="unknown FP8 scaling 'nvfp4': expected one of blockwise, mxfp8, tensorwise"):
        linear_format("nvfp4")

    class Other(LinearFormat):
        name = "mxfp8"

    with pytest.raises(ValueError, match="FP8 format 'mxfp8' is registered twice"):
        register_format(Other())
