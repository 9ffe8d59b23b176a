"""What would break first on a GPU cluster fails fast with one line: an attention implementation that ignores
the tree mask, sliding-window layers, a TP degree the heads do not divide, a CUDA device that is not there;
and the target group's rendezvous port stays held from its choice to its use."""

import json
import socket
from datetime import timedelta

import pytest
import ray
import torch
from tiny import char_tokenizer, save_tiny, tiny_model
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from actors.resources import Resources
from actors.target import TargetWorker
from jobs.cli import main
from treegraft_dist.decoding.sampling import SamplingParams
from treegraft_dist.models.loading import ModelError, load_model, pick_device, sliding_window_layers


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("guards")
    tok = char_tokenizer()
    out = {"plain": save_tiny(root / "plain", tiny_model("llama"), tok)}
    for impl in ("flash_attention_2", "flex_attention"):
        folder = save_tiny(root / impl, tiny_model("llama"), tok)
        config = json.loads((root / impl / "config.json").read_text())
        (root / impl / "config.json").write_text(json.dumps({**config, "attn_implementation": impl}))
        out[impl] = folder
    sliding = tiny_model("qwen3", use_sliding_window=True, sliding_window=16, max_window_layers=1)
    out["sliding"] = save_tiny(root / "sliding", sliding, tok)
    return out


def one_line_error(capsys, *argv) -> str:
    """The command's exit status must be 2 with one `treegraft: error:` line and no traceback; returns it."""
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("treegraft: error:")
    return last


def generate(folder: str, *extra: str) -> list[str]:
    return ["generate", "--target", folder, "--middle", "none", "--prompt", "abc", "--method", "ar",
            "--max-new-tokens", "2", "--dtype", "float32", *extra]


@pytest.mark.parametrize("impl", ["flash_attention_2", "flex_attention"])
def test_attention_that_ignores_the_tree_mask_is_refused(folders, capsys, impl):
    line = one_line_error(capsys, *generate(folders[impl], "--device", "cpu"))
    assert impl in line and "sdpa" in line and "mask" in line


def test_sdpa_and_eager_load(folders):
    assert load_model(folders["plain"], "cpu", "float32").lm.model.config._attn_implementation == "sdpa"


def test_sliding_window_layers_are_refused(folders, capsys):
    line = one_line_error(capsys, *generate(folders["sliding"], "--device", "cpu"))
    assert "sliding-window" in line and "1 of its 2 layers" in line


def test_sliding_window_layers_as_configs_express_them():
    assert sliding_window_layers(Qwen2Config(num_hidden_layers=4)) == []  # use_sliding_window false
    assert sliding_window_layers(Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=64,
                                             max_window_layers=2)) == [2, 3]
    assert sliding_window_layers(MistralConfig(num_hidden_layers=3, sliding_window=4096)) == [0, 1, 2]
    assert sliding_window_layers(MistralConfig(num_hidden_layers=3, sliding_window=None)) == []
    assert sliding_window_layers(LlamaConfig(num_hidden_layers=3)) == []


def test_a_tp_degree_the_heads_do_not_divide_fails_before_any_actor(folders, capsys):
    # 4 attention heads, 2 key/value heads: tp 4 cannot shard the key/value heads.
    line = one_line_error(capsys, *generate(folders["plain"], "--device", "cpu", "--distributed", "--tp", "4"))
    assert "--tp 4 cannot shard" in line and "4 attention heads and 2 key/value heads" in line
    assert "use --tp 1 or 2" in line
    assert not ray.is_initialized()
    from actors import DistributedEngine

    with pytest.raises(ModelError, match="--tp 4 cannot shard"):
        DistributedEngine(folders["plain"], resources=Resources(tp=4, device="cpu"))
    assert not ray.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_cuda_is_one_line(folders, capsys, device):
    line = one_line_error(capsys, *generate(folders["plain"], "--device", device, "--dtype", "auto"))
    assert f"--device {device}" in line and "--device cpu" in line
    with pytest.raises(ModelError, match="CUDA"):
        pick_device(device)


def test_an_unknown_device_is_one_line(folders, capsys):
    assert "unknown device 'gpu0'" in one_line_error(capsys, *generate(folders["plain"], "--device", "gpu0"))


def test_rank_0_holds_the_rendezvous_port_until_the_group_forms():
    worker = TargetWorker("unused", 0, Resources(tp=2, device="cpu", dist_timeout_s=10), SamplingParams(), "float32")
    host, port = worker.rendezvous()
    # Between the choice and its use nothing else can take the port: rank 0's store is listening on it.
    with socket.socket() as s, pytest.raises(OSError):
        s.bind(("", port))
    # The other ranks reach the group's store at the published address.
    peer = torch.distributed.TCPStore(host, port, 2, is_master=False, timeout=timedelta(seconds=10))
    peer.set("rank 1", "here")
    assert worker.store.get("rank 1") == b"here"
