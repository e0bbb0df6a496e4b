"""Every Python snippet of the README's quick start, run as a user runs it: written into a script
after a prelude that defines ``net``, ``loader`` and ``loss_fn`` (and the framework objects a
snippet names), launched with ``torchrun`` on 2 ranks, or on 2 nodes of 2 ranks where the snippet
is about nodes, and what the snippet says checked afterwards against what it printed out."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()

PRELUDE = '''
import os, sys
import torch
import torch.distributed as dist
from torch import nn

torch.manual_seed(0)
RANK, OUT = int(os.environ["RANK"]), os.environ["SNIPPET_OUT"]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(w, 16), nn.Tanh()) for w in (8, 16))
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(seed, size=16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 8, generator=g)
    return x, (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()


net = Net()
snapshots, losses = [], []


class Loader:
    """This rank's batches; it records the parameters before each step."""

    def __iter__(self):
        for step in range(STEPS):
            snapshots.append([p.detach().clone() for p in net.parameters()])
            yield batch(1000 * RANK + step)


def loss_fn(out, y):
    loss = nn.functional.cross_entropy(out, y)
    losses.append(loss.item())
    return loss


loader = Loader()
PROBE = batch(999, 256)
with torch.no_grad():
    probe_before = nn.functional.cross_entropy(net(PROBE[0]), PROBE[1]).item()
'''

LIGHTNING = """
import lightning.pytorch as pl


class LitNet(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = net

    def training_step(self, data, _):
        return loss_fn(self.net(data[0]), data[1])

    def configure_optimizers(self):
        from signmuon.optim import SignMuon

        return SignMuon(self.parameters(), lr=2e-3)


lightning_module = LitNet()
x, y = batch(7, 320)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
"""

HF = """
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

config = GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                    embd_pdrop=0.0, attn_pdrop=0.0)
net = hf_model = GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = (torch.arange(16) * 3 + i % 8) % 32  # a learnable pattern
        return {"input_ids": ids, "labels": ids}


dataset = Tokens()
probe = torch.stack([dataset[i]["input_ids"] for i in range(8)])
with torch.no_grad():
    probe_before = hf_model(input_ids=probe, labels=probe).loss.item()
training_args = TrainingArguments(output_dir="hf_out", max_steps=STEPS, per_device_train_batch_size=4,
                                  learning_rate=0.01, report_to=[], use_cpu=True, save_strategy="no",
                                  logging_strategy="no", disable_tqdm=True, seed=0)
"""


def _continued() -> str:
    """What the snippets after the first continue from: its imports, and the process group."""
    first = _blocks("python")[0]
    imports = [line for line in first.splitlines() if line.startswith(("import ", "from "))]
    return "\n".join(imports) + '\ndist.init_process_group("gloo")\n'


EPILOGUE = """
with torch.no_grad():
    if "hf_model" in globals():
        probe_after = hf_model(input_ids=probe, labels=probe).loss.item()
    else:
        probe_after = nn.functional.cross_entropy(net(PROBE[0]), PROBE[1]).item()
params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in net.parameters()]
result = {"params": [p.detach().clone() for p in params], "snapshots": snapshots, "probe": (probe_before, probe_after)}
result.update(EXTRA() if "EXTRA" in globals() else {})
torch.save(result, os.path.join(OUT, f"rank{RANK}.pt"))
if dist.is_initialized():
    dist.barrier()
sys.stdout.flush()
os._exit(0)  # gloo's threads outlive the group on torch 2.13; skip the interpreter's teardown
"""


def _blocks(language: str) -> list[str]:
    quick = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", quick, re.S)


# name: (what identifies its block, nodes of 2 ranks, the prelude's additions, its extra results)
CASES = {
    "ddp_hook": ("dist.init_process_group(", 1, "", ""),
    "signmuon": ("muon_param_groups(net)", 1, "continued", ""),
    "node_aware": (
        "VoteConfig(hierarchical=True)",
        2,
        "continued",
        "lambda: {'between': state.stats.bytes_sent_between_nodes, 'sent': state.stats.bytes_sent}",
    ),
    "fsdp": ("register_fsdp_vote(net", 2, "continued", ""),
    "deepspeed": ("sm_ds.initialize(", 1, "", "lambda: {'type': type(optimizer).__name__}"),
    "local_steps": (
        "LocalStepAverager(",
        2,
        "continued",
        "lambda: {'consensus': [t.clone() for t in weights.values()]}",
    ),
    "lightning": ("SignDDPStrategy()", 1, LIGHTNING, ""),
    "accelerate": ("register_comm_hook(accelerator", 1, "", ""),
    "hf_trainer": ("SignTrainer(", 1, HF, ""),
}
STEPS = {"local_steps": 20, "hf_trainer": 6}


def _case_of(block: str) -> list[str]:
    return [name for name, (marker, *_) in CASES.items() if marker in block]


def test_every_quick_start_snippet_has_a_case():
    blocks = _blocks("python")
    assert len(blocks) == len(CASES)
    assert sorted(name for block in blocks for name in _case_of(block)) == sorted(CASES)
    for block in blocks:
        lines = [line for line in block.splitlines() if line.strip()]
        assert len(lines) <= 16, f"a quick start of {len(lines)} lines: {lines[0]}"
    assert len(README.splitlines()) <= 250


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(name: str, tmp_path: Path) -> list[dict]:
    marker, nodes, extra_prelude, extra = CASES[name]
    block = next(b for b in _blocks("python") if marker in b)
    script = (
        f"STEPS = {STEPS.get(name, 8)}\n"
        + PRELUDE
        + (_continued() if extra_prelude == "continued" else extra_prelude)
        + block
        + (f"\nEXTRA = {extra}\n" if extra else "")
        + EPILOGUE
    )
    (tmp_path / "snippet.py").write_text(script)
    (tmp_path / "ds_config.json").write_text(_blocks("json")[0])
    out = tmp_path / "out"
    out.mkdir()
    env = {
        **os.environ,
        "SNIPPET_OUT": str(out),
        "OMP_NUM_THREADS": "1",
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions")),
    }
    port = _free_port()
    launches = [
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank", str(node),
         "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), "snippet.py"]
        for node in range(nodes)
    ]  # fmt: skip
    procs = [
        subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for cmd in launches
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-4000:] for log in logs)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2 * nodes)]


def _identical(results: list[dict]) -> bool:
    first = results[0]["params"]
    return all(all(torch.equal(a, b) for a, b in zip(first, r["params"])) for r in results[1:])


def _moved_by_exactly(result: dict, lr: float, after: int) -> bool:
    """From step ``after`` on, every entry moved by 0 or exactly ``lr`` at each step (a voted sign)."""
    snaps = result["snapshots"] + [result["params"]]
    for before, now in zip(snaps[after:], snaps[after + 1 :]):
        for a, b in zip(before, now):
            step = (b - a).abs()
            if not torch.all((step < 1e-7) | ((step - lr).abs() < 1e-6)):
                return False
    return True


def _trained(result: dict) -> bool:
    """The loss on a fixed probe batch fell (parameters that did not move cannot make it fall)."""
    before, after = result["probe"]
    return after < before


@pytest.mark.parametrize("name", list(CASES))
def test_quick_start_snippet_runs_as_written(name, tmp_path):
    needs = {
        "deepspeed": "deepspeed",
        "lightning": "lightning",
        "accelerate": "accelerate",
        "hf_trainer": "transformers",
    }
    if name in needs:
        pytest.importorskip(needs[name], reason=f"the {needs[name]} extra (part of the test extra)")
    results = _run(name, tmp_path)
    if name == "local_steps":
        # Rounds between nodes, local steps between them: each node's ranks agree, the nodes differ
        # after the last round's local steps, and every rank holds the same consensus.
        assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"]))
        assert not all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[2]["params"]))
        assert all(all(torch.equal(a, b) for a, b in zip(results[0]["consensus"], r["consensus"])) for r in results[1:])
        assert all(_trained(r) for r in results)
        return
    assert _identical(results), "the ranks' replicas differ"
    assert all(_trained(r) for r in results), [r["probe"] for r in results]
    if name in ("ddp_hook", "node_aware"):
        assert all(_moved_by_exactly(r, 1e-3, after=1) for r in results)  # the first step is all-reduced
    if name == "node_aware":
        assert 0 < results[0]["between"] < results[0]["sent"]
    if name == "deepspeed":
        assert results[0]["type"] == "SignMuon"
        assert json.loads(_blocks("json")[0])["optimizer"]["type"] == "SignMuon"


def test_the_snippets_prelude_is_a_checked_reference():
    # The exact-lr check above must fail on a plain SGD step (no vote): guard against a check that
    # passes whatever ran.
    torch.manual_seed(0)
    params = [torch.randn(4, 4)]
    snaps = [[p.clone() for p in params]]
    params[0] -= 1e-3 * torch.randn(4, 4)
    assert not _moved_by_exactly({"snapshots": snaps, "params": params}, 1e-3, after=0)
    params = [snaps[0][0] - 1e-3 * torch.sign(torch.randn(4, 4))]
    assert _moved_by_exactly({"snapshots": snaps, "params": params}, 1e-3, after=0)
