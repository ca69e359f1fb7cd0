"""The data side of a job's plan (fp8rl.controller.plan): a user's data file through ``data.task: dataset`` — chat
prompts rendered as the tokenizer's own template does, data.max_prompt_tokens dropping and counting, a held-out
validation file, seeded per-epoch order that a restarted controller repeats, and the submit-time checks."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fp8rl.config import ConfigError, parse_job_config
from fp8rl.controller.plan import JobPlan, check_data, eval_problems, load_split, problem_source
from fp8rl.data import DataFileError, DataRoot, Problem, epoch_permutation
from fp8rl.model.tokenizer import CharTokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture
def chat_tokenizer(tmp_path):
    """A tiny local HF tokenizer (WordLevel, trained here) with a ChatML chat template: no network."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.WordLevel(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(["user system assistant What is 1 2 3 4 + ? Be brief ."],
                            trainer=trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|im_start|>", "<|im_end|>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", eos_token="<|im_end|>",
                                  bos_token="<|im_start|>")
    tok.chat_template = CHATML
    tok.save_pretrained(str(tmp_path / "chat-tok"))
    return tmp_path / "chat-tok"


@pytest.fixture
def char_model(tmp_path):
    """A model directory whose tokenizer is the character one: one token per character (+ BOS), no template."""
    CharTokenizer().save(tmp_path / "char-tok")
    return tmp_path / "char-tok"


@pytest.fixture
def root(tmp_path):
    (tmp_path / "data").mkdir()
    return DataRoot(tmp_path / "data")


def job(model, n: int = 2, eval_every: int = 0, eval_size: int = 128, **data):
    return parse_job_config({"job": {"seed": 5, "eval_every": eval_every, "eval_size": eval_size},
                             "policy": {"model": str(model)}, "grpo": {"num_prompts_per_step": n},
                             "data": {"task": "dataset", **data}})


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path.name


def test_chat_prompts_render_as_the_tokenizers_own_template(chat_tokenizer, root):
    from transformers import AutoTokenizer

    rows = [{"prompt": [{"role": "system", "content": "Be brief ."}, {"role": "user", "content": "What is 1 + 2 ?"}],
             "reward_model": {"ground_truth": "3"}},
            {"prompt": [{"role": "user", "content": "What is 2 + 2 ?"}], "reward_model": {"ground_truth": "4"}}]
    pq.write_table(pa.Table.from_pylist(rows), root.root / "train.parquet")
    plan = JobPlan("t", job(chat_tokenizer, path="train.parquet", shuffle=False, chat_template=True,
                            system_prompt="Be brief ."), root)
    problems = plan.batch(0)
    assert [p.answer for p in problems] == ["3", "4"] and all(p.is_chat for p in problems)
    own = AutoTokenizer.from_pretrained(str(chat_tokenizer), local_files_only=True)
    want = []
    for row in rows:  # a row's own system message is kept; data.system_prompt goes first where there is none
        messages = row["prompt"] if row["prompt"][0]["role"] == "system" else \
            [{"role": "system", "content": "Be brief ."}, *row["prompt"]]
        text = own.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert text.endswith("<|im_start|>assistant\n") and text.count("system") == 1
        want.append(own(text, add_special_tokens=False)["input_ids"])
    assert plan.prompts(problems) == want

    # message-list prompts use the template even without data.chat_template; text prompts then stay BOS + text
    plain = JobPlan("t", job(chat_tokenizer, path="train.parquet", shuffle=False), root)
    text = own.apply_chat_template(rows[1]["prompt"], add_generation_prompt=True, tokenize=False)
    assert plain.prompts([problems[1]]) == [own(text, add_special_tokens=False)["input_ids"]]
    assert plain.prompts([Problem("What is 1 ?", "1")]) == [plain.tok.encode("What is 1 ?")]


def test_a_chat_prompt_with_pictures_renders_by_the_template_with_each_pictures_tokens_in_its_place(chat_tokenizer):
    """An image content part is a placeholder in its message; the template renders the chat, and each placeholder
    becomes its picture's vision-start, image (one per merged cell) and vision-end tokens — the processor's layout."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from fp8rl.data.shapes import ShapesDataset
    from fp8rl.model.config import ModelConfig
    from fp8rl.model.image_inputs import PromptImages, VisionProcessor
    from fp8rl.model.tokenizer import load_tokenizer
    from fp8rl.presets import tiny_vl as V

    cfg = V.tiny_vl_config(ModelConfig(architecture="qwen2", vocab_size=128, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=128))
    picture = ShapesDataset(0).eval_set(1)[0].images
    problem = Problem([{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "image"},
                                                    {"type": "text", "text": "?"}]}], "2", images=picture)
    plan = SimpleNamespace(images=PromptImages(VisionProcessor(cfg.vision_config, V.PREPROCESSOR), cfg),
                           tok=load_tokenizer(chat_tokenizer), job=parse_job_config(
                               "data: {chat_template: true, system_prompt: Be brief .}"))
    own = AutoTokenizer.from_pretrained(str(chat_tokenizer), local_files_only=True)
    text = own.apply_chat_template([{"role": "system", "content": "Be brief ."},
                                    {"role": "user", "content": "What is<image>?"}], add_generation_prompt=True,
                                   tokenize=False)
    head, tail = text.split("<image>")
    want = own(head, add_special_tokens=False)["input_ids"] + [cfg.vision_start_token_id] + \
        [cfg.image_token_id] * 4 + [cfg.vision_end_token_id] + own(tail, add_special_tokens=False)["input_ids"]
    assert JobPlan._encode(plan, problem) == want



def test_chat_prompts_without_a_chat_template_are_a_config_error(char_model, root):
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}]),
                   root.root / "chat.parquet")
    with pytest.raises(ConfigError, match=r"data.path: the prompts of 'chat.parquet' are chat messages \(problem 0 "
                                          r"is\), but the tokenizer of policy.model .* has no chat template"):
        JobPlan("t", job(char_model, path="chat.parquet"), root)


def test_max_prompt_tokens_drops_from_train_and_validation_and_counts(char_model, root):
    # the char tokenizer: a prompt of c characters is c + 1 tokens (BOS); the limit 6 keeps prompts of <= 5
    train = jsonl(root.root / "train.jsonl", [{"prompt": "x" * c, "answer": str(c)} for c in (3, 9, 5, 12, 4, 7)])
    val = jsonl(root.root / "val.jsonl", [{"question": "y" * c, "answer": f"#### {c}"} for c in (8, 2, 6, 1, 3)])
    plan = JobPlan("t", job(char_model, path=train, validation_path=val, max_prompt_tokens=6, eval_every=1,
                            eval_size=2), root)
    assert plan.dropped_prompts == {"train": 3, "validation": 2}  # validation: rows 8 and 6, before 2 were kept
    assert {p.answer for s in range(3) for p in plan.batch(s)} == {"3", "5", "4"}
    assert [p.answer for p in plan.eval_set] == ["#### 2", "#### 1"]
    assert all(len(ids) <= 6 for ids in plan.prompts(plan.eval_set + plan.batch(0)))

    # no validation file: the train file's first rows (file order), counted as they are read
    plan = JobPlan("t", job(char_model, path=train, max_prompt_tokens=6, eval_every=1, eval_size=2), root)
    assert [p.answer for p in plan.eval_set] == ["3", "5"] and plan.dropped_prompts == {"train": 3, "validation": 1}
    # the same rules outside a plan (the in-process loop's final evaluation)
    assert eval_problems(job(char_model, path=train, max_prompt_tokens=6, eval_size=2), root) == plan.eval_set
    assert load_split(job(char_model, path=train), "train", root).dropped == 0

    with pytest.raises(ValueError, match=r"data.path: 'train.jsonl' holds no problems \(6 longer than "
                                         r"data.max_prompt_tokens=2 tokens were dropped\)"):
        JobPlan("t", job(char_model, path=train, max_prompt_tokens=2), root)


def test_training_order_is_a_seeded_permutation_per_epoch_that_a_restart_repeats(char_model, root):
    train = jsonl(root.root / "t.jsonl", [{"prompt": f"{i} + 1 =", "answer": str(i + 1)} for i in range(6)])
    pq.write_table(pa.Table.from_pylist([{"prompt": f"{i} + 1 =", "answer": str(i + 1)} for i in range(6)]),
                   root.root / "t.parquet")
    first = JobPlan("t", job(char_model, path="t.parquet", n=4), root)
    restarted = JobPlan("t", job(char_model, path="t.parquet", n=4), root)  # a controller restarted mid-job
    order = [int(p.answer) - 1 for s in range(3) for p in first.batch(s)]  # 12 positions: two epochs
    assert order == [int(p.answer) - 1 for s in range(3) for p in restarted.batch(s)]
    assert order == [*epoch_permutation(6, 5, 0), *epoch_permutation(6, 5, 1)] and order[:6] != order[6:]
    assert sorted(order[:6]) == sorted(order[6:]) == list(range(6))

    # data.shuffle: false (and task jsonl by default) keep file order; task jsonl may ask for the shuffle
    for cfg in ({"path": "t.parquet", "shuffle": False}, {"path": train, "task": "jsonl"}):
        assert [p.answer for p in problem_source(job(char_model, n=4, **cfg), root)(1)] == ["5", "6", "1", "2"]
    shuffled = problem_source(job(char_model, n=4, path=train, task="jsonl", shuffle=True), root)
    assert [int(p.answer) - 1 for p in shuffled(0)] == order[:4]


def test_submit_checks_both_paths_without_reading_rows(char_model, root, tmp_path):
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1=", "answer": "2"}]), root.root / "ok.parquet")
    (root.root / "rows.csv").write_text("prompt,answer\n")
    (tmp_path / "outside.jsonl").write_text("{}\n")
    check_data(job(char_model, path="ok.parquet", validation_path="ok.parquet"), root)
    with pytest.raises(DataFileError, match=r"^data.path: cannot tell the format of .*rows.csv"):
        check_data(job(char_model, path="rows.csv"), root)
    with pytest.raises(DataFileError, match=r"^data.validation_path: '../outside.jsonl' resolves to .*outside the "
                                            r"data root"):
        check_data(job(char_model, path="ok.parquet", validation_path="../outside.jsonl"), root)
    with pytest.raises(DataFileError, match=r"^data.path: .* is a directory but no Arrow dataset"):
        check_data(job(char_model, path="."), root)
    check_data(job(char_model, path="rows.csv", task="jsonl"), root)  # jsonl: JSON lines whatever the name
    with pytest.raises(DataFileError, match=r"^data.path: 'missing' does not exist under the data root"):
        check_data(job(char_model, path="missing"), root)


def test_a_plan_reads_its_training_file_once_when_validation_comes_from_it(char_model, root, monkeypatch):
    """No validation file: the validation rows are the training file's first rows, taken from the one read; a
    validation file is read on its own. with_eval_set loads the set even when the job never validates (the loop)."""
    import fp8rl.controller.plan as plan_mod

    train = jsonl(root.root / "train.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(6)])
    reads: list[str] = []
    real = plan_mod.read_problems

    def counting(data, path, **kw):
        reads.append(str(path))
        return real(data, path, **kw)

    monkeypatch.setattr(plan_mod, "read_problems", counting)
    plan = JobPlan("t", job(char_model, path=train, eval_every=1, eval_size=3), root)
    assert [p.answer for p in plan.eval_set] == ["0", "1", "2"] and reads == [str(train)]
    reads.clear()
    loop = JobPlan("t", job(char_model, path=train, eval_every=0, eval_size=3), root, with_eval_set=True)
    assert loop.eval_set == plan.eval_set and reads == [str(train)]
    assert JobPlan("t", job(char_model, path=train, eval_every=0), root).eval_set == []
