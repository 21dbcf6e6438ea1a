"""Resuming a distributed (``torchrun``) run: every process gets its own random generators back.

Each process draws its own dropout masks (its torch generator is seeded with seed + rank). A
checkpoint keeps the generator states of every process and each restores its own, so a resumed
run continues as the uninterrupted one; a checkpoint of another number of processes gives each
process fresh generators of its own, and says so.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

pytest.importorskip("safetensors")

from attnlab.translate import checkpoint as ckpt  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# Two processes on gloo, forked from one that imported torch and attnlab once (a torchrun
# start-up imports them three times). Each trains 6 steps with dropout, then 3 steps, stops
# and resumes to 6; it writes both models' parameters.
TWO_PROCESSES = textwrap.dedent(
    """
    import datetime, multiprocessing, os, sys
    import safetensors.torch, torch, torch._dynamo  # (what the processes need, imported once)
    import torch.distributed as tdist
    import attnlab.nn, attnlab.translate.progress
    from attnlab.data import Pair
    from attnlab.translate.batching import encode_pairs
    from attnlab.translate.models import build_model, model_config
    from attnlab.translate.tokenizer import Tokenizer
    from attnlab.translate.trainer import TrainOptions, fit, init_distributed

    out = sys.argv[1]

    def process(rank):
        os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank))
        tdist.init_process_group(
            "gloo", init_method=f"file://{out}/store", rank=rank, world_size=2,
            timeout=datetime.timedelta(seconds=60),
        )
        torch.set_num_threads(1)
        pairs = [Pair(f"{i} {i * 7 % 10}", f"{i * 7 % 10} {i}", str(i)) for i in range(24)]
        tok = Tokenizer.train([p.source for p in pairs] + [p.target for p in pairs], "char")
        data, _ = encode_pairs(tok, pairs)
        config = model_config("transformer", "multihead", "tiny", dropout=0.5)
        opts = TrainOptions(lr=3e-3, warmup=2, max_tokens=40, max_steps=6, seed=3,
                            checkpoint_seconds=1e6)
        dist = init_distributed("cpu")

        def trained(run, **how):
            torch.manual_seed(0)
            model = build_model(config, tok.vocab_size)
            fit(model, data, data, opts, f"{out}/{run}", dist=dist, progress_bar=False, **how)
            return model.state_dict()

        whole = trained("whole")
        trained("cut", stop_at_step=3)
        resumed = trained("cut", resume=True)
        torch.save({"whole": whole, "resumed": resumed}, f"{out}/rank{rank}.pt")
        tdist.destroy_process_group()

    if __name__ == "__main__":
        ranks = [multiprocessing.get_context("fork").Process(target=process, args=(r,))
                 for r in range(2)]
        for p in ranks:
            p.start()
        for p in ranks:
            p.join(120)
        for p in ranks:
            if p.is_alive():
                p.kill()
        sys.exit(max(9 if p.exitcode is None else abs(p.exitcode) for p in ranks))
    """
)


def test_a_resumed_two_process_run_equals_the_uninterrupted_one(tmp_path):
    """Before: the checkpoint held process 0's generators and every process restored them, so
    after a resume both processes drew process 0's dropout masks, and training took another
    path than the uninterrupted run's."""
    script = tmp_path / "two_processes.py"
    script.write_text(TWO_PROCESSES, encoding="utf-8")
    env_cmd = [sys.executable, str(script), str(tmp_path)]
    proc = subprocess.run(env_cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        whole, resumed = saved["whole"], saved["resumed"]
        for name in whole:
            assert torch.equal(whole[name], resumed[name]), (rank, name)
    state = ckpt.read_checkpoint_state(ckpt.latest_checkpoint(tmp_path / "cut"))
    assert state["rng"]["world_size"] == 2 and len(state["rng"]["ranks"]) == 1


# ------------------------------------------------------------------------------ in one process
def generators(seed: int) -> tuple[dict, dict]:
    """The :func:`ckpt.rng_state` a process would have with its generators seeded so."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)  # noqa: NPY002 - the global generator a checkpoint saves
    return ckpt.rng_state()


@pytest.fixture
def two_process_checkpoint(tmp_path):
    """A checkpoint written for two processes with generators seeded 10 and 11."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    states = [generators(10), generators(11)]
    folder = ckpt.save_checkpoint(tmp_path, 1, model, optimizer, {"step": 1}, rng=states)
    return folder, model, optimizer, states


def test_each_process_restores_its_own_generators(two_process_checkpoint, capsys):
    folder, model, optimizer, states = two_process_checkpoint
    for rank in (1, 0):
        generators(99)
        ckpt.load_checkpoint(folder, model, optimizer, rank=rank, world=2)
        tensors, info = states[rank]
        assert torch.equal(torch.get_rng_state(), tensors["rng.torch"])
        assert random.getstate() == ckpt._python_state(info)
        assert np.random.get_state()[2] == info["numpy"][2]  # noqa: NPY002 - (its position)
    assert capsys.readouterr().err == ""  # nothing to say


@pytest.mark.parametrize("world", [1, 3])
def test_another_number_of_processes_gets_fresh_distinct_generators_and_is_told(
    two_process_checkpoint, capsys, world
):
    """A checkpoint of 2 processes resumed by 1 or 3: no process can take "its" generators;
    each gets fresh ones, reproducible and different per process, and a line says so."""
    folder, model, optimizer, states = two_process_checkpoint
    drawn = []
    for rank in range(world):
        ckpt.load_checkpoint(folder, model, optimizer, rank=rank, world=world)
        drawn.append(torch.rand(4))
        ckpt.load_checkpoint(folder, model, optimizer, rank=rank, world=world)
        assert torch.equal(torch.rand(4), drawn[-1])  # reproducible
    saved = []
    for tensors, _ in states:
        torch.set_rng_state(tensors["rng.torch"])
        saved.append(torch.rand(4))
    assert len({tuple(t.tolist()) for t in drawn + saved}) == world + 2  # all different
    err = capsys.readouterr().err
    said = f"note: checkpoint {folder.name}: its random generators are those of 2 process(es)"
    assert err.count(said) == 2  # process 0's two loads, no other process's
    assert f"and this run has {world}: each process starts fresh ones" in err


def test_a_checkpoint_from_before_is_one_process_s(two_process_checkpoint):
    """Checkpoints written before every process's states were kept have no world_size: they
    are one process's (all a torchrun checkpoint then held was process 0's)."""
    _, _, _, states = two_process_checkpoint
    tensors, info = states[0]  # (the json of an older checkpoint: no world_size, no ranks)
    assert ckpt.set_rng_state(tensors, info, rank=0, world=1) is None
    assert torch.equal(torch.get_rng_state(), tensors["rng.torch"])
    note = ckpt.set_rng_state(tensors, info, rank=1, world=2)
    assert note is not None and "those of 1 process(es) and this run has 2" in note
