"""Final weights and sample.py: saving, loading, generation with and without the KV cache, bad input."""

import json

import pytest
import torch
from torch.testing import assert_close

import sample
import tokenize_text
import train_gpt as T
from conftest import in_process, one_line_error, random_model


def run_sample(*argv):
    return in_process(sample.main, *argv)


@pytest.mark.slow  # reads the SHORT run's final weights: its fixture trains
def test_final_weights_are_complete_and_load_safely(final_folder):
    assert sorted(p.name for p in final_folder.iterdir()) == ["config.json", "model.pt"]
    assert not list(final_folder.parent.glob(".*"))  # no temporary folder left behind
    state = torch.load(final_folder / "model.pt", weights_only=True)
    assert not any("optimizer" in k or "exp_avg" in k for k in state)
    info = json.loads((final_folder / "config.json").read_text())
    assert info["config"]["num_iterations"] == 8 and info["windows"] == [3, 10]  # the extension's short, final long
    model, args, _ = T.load_final_weights(final_folder, torch.device("cpu"))
    assert not model.training and args.num_iterations == 8
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, torch.Tensor) and name in state:
            assert torch.equal(tensor, state[name].to(tensor.dtype)), name
    assert model.rotary.window == 7  # YaRN's state came back too: fitted to the extension's long window


def test_sample_prints_text_and_repeats_itself_with_the_same_seed(untrained_final_folder):
    command = [untrained_final_folder, "--prompt=ROMEO:", "--max_new_tokens=20", "--seed=1"]
    first, second = run_sample(*command), run_sample(*command)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("ROMEO:") and len(first.stdout) > len("ROMEO:\n")
    assert first.stdout == second.stdout
    other = run_sample(untrained_final_folder, "--prompt=ROMEO:", "--max_new_tokens=20", "--seed=2")
    assert other.stdout != first.stdout


@pytest.mark.slow  # 90 tokens generated twice, then 86 positions fed twice (6 s)
def test_cached_and_uncached_generation_agree():
    model, args, info = random_model()
    prompt = [464, 3290, 11, 257, 1110, 13]
    # 90 tokens: past the longest window (64 positions), where the cache starts to drop keys
    cached, why = sample.generate(model, args, info, prompt, 90, 0.0, 0, 0, use_cache=True)
    uncached, _ = sample.generate(model, args, info, prompt, 90, 0.0, 0, 0, use_cache=False)
    assert len(cached) == 90 and len(set(cached)) > 5  # not one token repeated
    assert cached == uncached
    # the logits themselves, position by position, over a sequence longer than the longest window (64)
    tokens = [T.BOS_ID] + prompt + cached[:80]
    with_cache = sample.Generator(model, args, (1, 4), 160, use_cache=True)
    without = sample.Generator(model, args, (1, 4), 160, use_cache=False)
    assert_close(with_cache.feed(tokens[:5]), without.feed(tokens[:5]), rtol=1e-6, atol=1e-6)
    for token in tokens[5:]:
        assert_close(with_cache.feed([token]), without.feed([token]), rtol=1e-6, atol=1e-6)


def test_generation_stops_at_end_of_text_and_at_the_context():
    model, args, info = random_model()
    with torch.no_grad():  # make <|endoftext|> overwhelmingly likely after the prompt
        model.lm_head[:, T.BOS_ID] += 50 * model.lm_head.std()
    tokens, why = sample.generate(model, args, info, [464], 50, 0.0, 0, 0)
    assert why == "<|endoftext|>"
    model, args, info = random_model()
    tokens, why = sample.generate(model, args, info, [464] * 150, 50, 0.0, 0, 0)
    # the model reads at most 160 positions; the last token is predicted from the full context
    assert why.startswith("the context is full") and 151 + len(tokens) - 1 == 160


def test_temperature_and_top_k():
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    assert sample.choose(logits, 0.0, 0, torch.Generator()) == 1
    picks = {sample.choose(logits, 1.0, 2, torch.Generator().manual_seed(s)) for s in range(200)}
    assert picks == {1, 2}  # top-2 only, and both of them


def test_bad_input_is_a_one_line_error(untrained_final_folder, tmp_path):
    one_line_error(run_sample(tmp_path / "missing", "--prompt=x"), "no such folder")
    one_line_error(run_sample(tmp_path, "--prompt=x"), "not a final-weights folder")
    (tmp_path / "config.json").write_text('{"format": "something else"}')
    (tmp_path / "model.pt").write_bytes(b"")
    one_line_error(run_sample(tmp_path, "--prompt=x"), "config.json", "not train_gpt.py's final-weights config")
    one_line_error(run_sample(untrained_final_folder, "--prompt="), "--prompt: give a non-empty prompt")
    one_line_error(run_sample(untrained_final_folder, "--prompt=" + "word " * 600), "exceed the model's context of 128")
    one_line_error(run_sample(untrained_final_folder, "--prompt=x", "--temperature=-1"), "--temperature=-1.0")


def test_a_damaged_bundled_tokenizer_is_named_without_a_flag_sample_py_lacks(tmp_path, monkeypatch):
    damaged = tmp_path / "gpt2.tiktoken"
    damaged.write_bytes(tokenize_text.BUNDLED_BPE.read_bytes()[:-20])
    monkeypatch.setattr(tokenize_text, "BUNDLED_BPE", damaged)
    with pytest.raises(sample.SampleError, match=rf"^{damaged}: sha256 [0-9a-f]+ is not the bundled GPT-2 file's"):
        sample.load_tokenizer()
