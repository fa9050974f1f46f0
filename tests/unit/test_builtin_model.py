"""The built-in tiny model: deterministic bytes, loadable by transformers, a lossless tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import builtin_model as bm

# Its fixture builds the model in two CLI processes, and the tokenizer checks are property tests.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Path, str]]:
    """Write the model twice with the CLI, in two processes run side by side that differ in hash
    seed and tokenizer threading. Returns (cache dir, stdout) per run."""
    variants = [
        {"PYTHONHASHSEED": "1", "TOKENIZERS_PARALLELISM": "true"},
        {"PYTHONHASHSEED": "4242", "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"},
    ]
    procs = []
    for extra in variants:
        env = {**os.environ, **extra}
        env.pop("ENGINE_CACHE_DIR", None)
        cache = tmp_path_factory.mktemp("engine-cache")
        cmd = [sys.executable, "-m", "engine.builtin_model", "--cache-dir", str(cache)]
        pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append((cache, subprocess.Popen(cmd, env=env, **pipes)))
    runs = []
    for cache, proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        runs.append((cache, stdout))
    return runs


@pytest.fixture(scope="module")
def model_dir(cli_runs: list[tuple[Path, str]]) -> str:
    return str(cli_runs[0][0] / bm.BUILTIN_MODEL_DIRNAME)


@pytest.fixture(scope="module")
def tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _read_all(directory: str) -> dict[str, bytes]:
    return {name: Path(directory, name).read_bytes() for name in sorted(os.listdir(directory))}


# --------------------------------------------------------------------------- writing


def test_cli_writes_identical_bytes_in_separate_processes(cli_runs: list[tuple[Path, str]]) -> None:
    written = []
    for cache, stdout in cli_runs:
        expected = str(cache / bm.BUILTIN_MODEL_DIRNAME)
        assert stdout.strip().splitlines()[-1] == expected  # the CLI prints the path last
        assert sorted(os.listdir(cache)) == [bm.BUILTIN_MODEL_DIRNAME]  # no staging leftovers
        written.append(_read_all(expected))
    first, second = written
    assert sorted(first) == sorted(bm.MODEL_FILES)
    assert first.keys() == second.keys()
    for name in first:
        assert first[name] == second[name], f"{name} differs between writes"


def test_in_process_build_matches_written_files(model_dir: str) -> None:
    from safetensors.torch import load_file

    written = load_file(os.path.join(model_dir, "model.safetensors"))
    built = bm.build_state_dict()
    assert written.keys() == built.keys()
    assert all(torch.equal(written[name], built[name]) for name in built)
    tokenizer_json = Path(model_dir, "tokenizer.json").read_bytes()
    assert bm._json_bytes(json.loads(bm.build_tokenizer().to_str())) == tokenizer_json


def test_json_files_have_sorted_keys(model_dir: str) -> None:
    for name in bm.MODEL_FILES:
        if name.endswith(".json"):
            text = Path(model_dir, name).read_text(encoding="utf-8")
            obj = json.loads(text)
            assert text == json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def test_reuses_complete_dir_without_rewriting(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_write(out_dir: str) -> None:
        raise AssertionError("an existing complete directory must be reused")

    monkeypatch.setattr(bm, "write_builtin_model", must_not_write)
    assert bm.ensure_builtin_model(str(Path(model_dir).parent)) == model_dir


def _fake_writer(out_dir: str) -> None:
    for name in bm.MODEL_FILES:
        Path(out_dir, name).write_text("fake")


def test_replaces_incomplete_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / bm.BUILTIN_MODEL_DIRNAME
    target.mkdir()
    (target / "config.json").write_text("{}")  # a leftover missing most files
    monkeypatch.setattr(bm, "write_builtin_model", _fake_writer)
    assert bm.ensure_builtin_model(str(tmp_path)) == str(target)
    assert bm.is_complete_model_dir(str(target))
    assert (target / "config.json").read_text() == "fake"
    assert sorted(os.listdir(tmp_path)) == [bm.BUILTIN_MODEL_DIRNAME]


def test_losing_a_publish_race_keeps_the_winner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / bm.BUILTIN_MODEL_DIRNAME

    def writer_that_loses(out_dir: str) -> None:
        _fake_writer(out_dir)
        target.mkdir()  # another process publishes while we are still writing
        for name in bm.MODEL_FILES:
            (target / name).write_text("winner")

    monkeypatch.setattr(bm, "write_builtin_model", writer_that_loses)
    assert bm.ensure_builtin_model(str(tmp_path)) == str(target)
    assert (target / "model.safetensors").read_text() == "winner"
    assert sorted(os.listdir(tmp_path)) == [bm.BUILTIN_MODEL_DIRNAME]


def test_default_location(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    assert bm.builtin_model_dir() == str(tmp_path / "builtin-model-v2")
    monkeypatch.delenv("ENGINE_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert bm.builtin_model_dir() == str(tmp_path / "home" / ".cache" / "engine" / "builtin-model-v2")
    assert not (tmp_path / "home").exists()  # computing the path writes nothing


def test_weights_are_seeded_normal_with_unit_norms(model_dir: str) -> None:
    from safetensors.torch import load_file

    state = load_file(os.path.join(model_dir, "model.safetensors"))
    embed = state["model.embed_tokens.weight"]
    assert embed.shape == (bm.SPEC.vocab_size, bm.SPEC.hidden_size) and embed.dtype == torch.float32
    assert abs(embed.std().item() - 0.02) < 5e-4 and abs(embed.mean().item()) < 5e-4
    assert torch.equal(state["model.norm.weight"], torch.ones(bm.SPEC.hidden_size))
    assert not torch.equal(state["lm_head.weight"], embed)  # untied
    assert len(state) == 2 + 9 * bm.SPEC.num_hidden_layers + 1


# --------------------------------------------------------------------------- transformers


def test_loads_in_transformers_and_forward_is_finite(model_dir: str, tokenizer) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(model_dir)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (4, 256, 688)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 4, 32)
    assert config.vocab_size == len(tokenizer) == bm.VOCAB_SIZE
    assert config.max_position_embeddings == 2048 and config.tie_word_embeddings is False
    assert config.bos_token_id == bm.BOS_TOKEN_ID and config.eos_token_id == bm.EOS_TOKEN_ID

    generation = GenerationConfig.from_pretrained(model_dir)
    assert generation.eos_token_id == [bm.EOS_TOKEN_ID, bm.EOT_TOKEN_ID]
    assert generation.bos_token_id == bm.BOS_TOKEN_ID

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert next(model.parameters()).dtype == torch.float32
    ids = tokenizer("The harbour at dawn, 港口 🌅").input_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), bm.VOCAB_SIZE)
    assert torch.isfinite(logits).all()
    assert logits.std() > 0  # random weights, not zeros


def test_special_tokens_and_bos(tokenizer) -> None:
    assert tokenizer.bos_token == bm.BOS_TOKEN and tokenizer.bos_token_id == 0
    assert tokenizer.eos_token == bm.EOS_TOKEN and tokenizer.eos_token_id == 1
    assert tokenizer.pad_token == bm.PAD_TOKEN and tokenizer.pad_token_id == bm.PAD_TOKEN_ID
    assert tokenizer.convert_tokens_to_ids(list(bm.SPECIAL_TOKENS)) == list(range(len(bm.SPECIAL_TOKENS)))
    assert tokenizer.model_max_length == 2048

    ids = tokenizer("hi").input_ids
    assert ids[0] == bm.BOS_TOKEN_ID and bm.BOS_TOKEN_ID not in ids[1:]
    assert tokenizer("hi", add_special_tokens=False).input_ids == ids[1:]
    # Special token text in input maps to the single special id, and decodes back.
    chat_ids = tokenizer.encode("<|user|>x<|eot|>", add_special_tokens=False)
    assert chat_ids[0] == bm.SPECIAL_TOKENS.index(bm.USER_TOKEN) and chat_ids[-1] == bm.EOT_TOKEN_ID
    assert tokenizer.decode(chat_ids, skip_special_tokens=True) == "x"


def test_chat_template(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "More"}]},
    ]
    body = (
        "<|begin_of_text|><|system|>\nBe brief.<|eot|>\n<|user|>\nHi<|eot|>\n"
        "<|assistant|>\nHello!<|eot|>\n<|user|>\nMore<|eot|>\n"
    )
    assert tokenizer.apply_chat_template(messages, tokenize=False) == body
    with_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert with_prompt == body + "<|assistant|>\n"

    ids = tokenizer.encode(with_prompt, add_special_tokens=False)
    assert ids[0] == bm.BOS_TOKEN_ID and ids.count(bm.BOS_TOKEN_ID) == 1
    assert ids.count(bm.EOT_TOKEN_ID) == 4
    with pytest.raises(Exception, match="Unsupported chat role"):
        tokenizer.apply_chat_template([{"role": "robot", "content": "beep"}], tokenize=False)


def test_chat_template_with_tools(tokenizer) -> None:
    """Hermes-style tools: signatures in the system turn, calls in <tool_call>, results as a user
    turn in <tool_response>; the prompt without tools is unchanged by their support."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|begin_of_text|><|system|>\nBe brief.\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert text.count("<|system|>") == 1
    assert ('<|assistant|>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|eot|>\n") in text
    assert text.endswith("<|user|>\n<tool_response>\nsunny\n</tool_response><|eot|>\n<|assistant|>\n")
    plain = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert plain == "<|begin_of_text|><|system|>\nBe brief.<|eot|>\n<|user|>\nWeather?<|eot|>\n<|assistant|>\n"


# --------------------------------------------------------------------------- round trips

_HARD_STRINGS = [
    "",
    " ",
    "  leading and trailing  ",
    "naïve café, Ærøskøbing, Łódź, İstanbul",
    "e\u0301 vs \u00e9, a\u0328\u0337\u0322, \u1100\u1161\u11a8",
    "日本語、中文、한국어 and ｶﾀｶﾅ",
    "👩‍👩‍👧‍👦 🏳️‍🌈 🇺🇳 👋🏾 🫠",
    "tab\tnewline\ncr\r\nbell\x07 escape\x1b[0m del\x7f nul\x00",
    "\U0010fffd\ufeff\u200b\u2028\u2029",
    "𒀀𓀀𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ᚠᛇᚻ ꦲꦤꦕꦫꦏ",  # scripts absent from the corpus
    "def f(x):\n    return x ** 2  # ok\n",
    "<|begin_of_text|> literal <|eot|> markers <|pad|>",
]


@pytest.mark.parametrize("text", _HARD_STRINGS)
def test_round_trip_hard_strings(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < bm.VOCAB_SIZE for i in ids)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text())
def test_round_trip_any_text(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_frequent_words_are_single_tokens(tokenizer) -> None:
    # A trained vocabulary, not just bytes: common words and multi-byte CJK pieces are merged.
    assert len(tokenizer.encode(" the", add_special_tokens=False)) == 1
    assert len(tokenizer.encode("的", add_special_tokens=False)) == 1
    assert len(tokenizer.encode(" request", add_special_tokens=False)) == 1


def test_the_launcher_resolves_the_model_and_ports_without_importing_torch(model_dir: str) -> None:
    """Everything the launcher does before it spawns the schedulers (flags, the built-in model's
    path, ports) runs without torch: its import would delay every child's start by seconds."""
    script = (
        "import sys\n"
        "from engine.launch_server import parse_server_args\n"
        "from engine.launch.processes import resolve_model_path\n"
        "from engine.port_args import PortArgs\n"
        "args = resolve_model_path(parse_server_args(['--device', 'cpu']))\n"
        "PortArgs.init_new(args)\n"
        "print(args.model_path, 'torch' in sys.modules)\n"
    )
    env = {**os.environ, "ENGINE_CACHE_DIR": str(Path(model_dir).parent)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    path, torch_imported = out.stdout.split()
    assert path == model_dir and bm.is_complete_model_dir(path)
    assert torch_imported == "False"
