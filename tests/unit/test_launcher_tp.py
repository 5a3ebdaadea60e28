"""``pdserve up`` with tensor parallelism, without starting anything: each role's TP size (its
own flag, else --tensor-parallel-size), the CPUs and GPUs each worker gets for its ranks, and the
one-line refusal of a size the model or the GPUs cannot take, before any process starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.cli import main, make_parser
from pdserve.services.control import launcher as launcher_module
from pdserve.services.control import local_nats
from pdserve.services.control.launcher import Launcher, gpu_for_worker, tp_refusal
from pdserve.shared.config import EngineConfig, UpConfig
from pdserve.shared.cpus import cpu_shares
from pdserve.shared.errors import StartupError

LAYOUT_VARS = (
    "CUDA_VISIBLE_DEVICES",
    "PDSERVE_DEVICE",
    "PDSERVE_TENSOR_PARALLEL_SIZE",
    "PDSERVE_PREFILL_TENSOR_PARALLEL_SIZE",
    "PDSERVE_DECODE_TENSOR_PARALLEL_SIZE",
    "PDSERVE_PREFILL_WORKERS",
    "PDSERVE_DECODE_WORKERS",
    "PDSERVE_TORCH_THREADS",
    "PDSERVE_UCX_PORT",
    "PDSERVE_SPLIT_CPUS",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flags' defaults come from PDSERVE_* variables: none from the caller's shell."""
    for name in LAYOUT_VARS:
        monkeypatch.delenv(name, raising=False)


def launcher(*flags: str) -> Launcher:
    return Launcher(make_parser().parse_args(["up", *flags]))


def model_dir(tmp_path: Path, heads: int, kv_heads: int) -> Path:
    """The smallest config.json ModelConfig.from_dir accepts (no weights: nothing loads them)."""
    config = {
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": heads * 8,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


# ---- each role's TP size -------------------------------------------------------------------


def test_each_role_takes_its_own_size_else_the_common_one() -> None:
    assert launcher().tps == {"prefill": 1, "decode": 1}
    assert launcher("--tensor-parallel-size", "2").tps == {"prefill": 2, "decode": 2}
    both = launcher("--tensor-parallel-size", "4", "--decode-tensor-parallel-size", "1")
    assert both.tps == {"prefill": 4, "decode": 1}
    assert launcher("--prefill-tensor-parallel-size", "2").tps == {"prefill": 2, "decode": 1}


def test_the_role_sizes_come_from_the_environment_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_PREFILL_TENSOR_PARALLEL_SIZE", "2")
    assert launcher().tps == {"prefill": 2, "decode": 1}
    assert launcher("--prefill-tensor-parallel-size", "0").tps == {"prefill": 1, "decode": 1}


def test_a_negative_role_size_is_refused() -> None:
    with pytest.raises(StartupError, match=r"^--decode-tensor-parallel-size must be >= 0"):
        UpConfig(decode_tensor_parallel_size=-1)


def test_each_worker_starts_with_its_roles_size_and_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[tuple[str, dict[str, str], list[int] | None]] = []

    def spawn(name: str, argv: list[str], env: dict[str, str], cpus: list[int] | None = None):
        started.append((name, env, cpus))

    monkeypatch.setattr(launcher_module, "spawn", spawn)
    up = launcher(
        "--prefill-tensor-parallel-size", "2", "--decode-workers", "2", "--ucx-port", "7000"
    )
    up.gpus = ["0", "1", "2", "3"]
    assert up._plan_cpus(list(range(8))) is None
    for role, n in up._worker_counts().items():
        for i in range(n):
            up._start_worker(role, i, {})
    layout = [
        (name, env["PDSERVE_TENSOR_PARALLEL_SIZE"], env["CUDA_VISIBLE_DEVICES"], cpus)
        for name, env, cpus in started
    ]
    # prefill's 2 ranks take GPUs 0 and 1 and half the CPUs; each decode worker one of the rest
    assert layout == [
        ("prefill-0", "2", "0,1", [0, 1, 2, 3]),
        ("decode-0", "1", "2", [4, 5]),
        ("decode-1", "1", "3", [6, 7]),
    ]
    # a UCX port per rank: prefill-0's ranks may listen on 7000 and 7001
    assert [env["PDSERVE_UCX_PORT"] for _, env, _ in started] == ["7000", "7002", "7003"]
    assert launcher("--tensor-parallel-size", "2").workers_banner() == (
        "prefill workers: 1 (TP 2), decode workers: 1 (TP 2)"
    )
    assert launcher().workers_banner() == "prefill workers: 1, decode workers: 1"


# ---- CPUs and GPUs, weighed by ranks -------------------------------------------------------


def test_cpu_shares_split_the_cpus_between_tp1_workers() -> None:
    assert cpu_shares([0, 1], [1, 1]) == [[0], [1]]
    assert cpu_shares([0, 1, 2, 3, 4], [1, 1]) == [[0, 1, 2], [3, 4]]  # prefill (first) gets more
    assert cpu_shares(list(range(8)), [1] * 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert cpu_shares([0, 1], [1] * 4) is None  # fewer CPUs than workers: they share them all
    assert cpu_shares([0, 1], []) is None


def test_cpu_shares_weigh_each_worker_by_its_ranks() -> None:
    assert cpu_shares(list(range(6)), [2, 1]) == [[0, 1, 2, 3], [4, 5]]
    assert cpu_shares(list(range(6)), [1, 2]) == [[0, 1], [2, 3, 4, 5]]
    # 7 CPUs over 3 ranks: the first rank, prefill's, takes the one left over
    assert cpu_shares(list(range(7)), [2, 1]) == [[0, 1, 2, 3, 4], [5, 6]]
    assert cpu_shares(list(range(8)), [1, 4]) == [[0, 1], [2, 3, 4, 5, 6, 7]]
    # 3 CPUs, 4 ranks (2 TP-2 workers): fewer CPUs than ranks, so they share them all
    assert cpu_shares([0, 1, 2], [2, 2]) is None


def test_sharing_the_cpus_splits_the_threads_between_all_ranks() -> None:
    up = launcher("--tensor-parallel-size", "2", "--decode-workers", "2")  # 6 ranks
    assert up._plan_cpus([0, 1, 2, 3]) == 1 and up.cpu_shares is None  # fewer CPUs than ranks
    assert up._plan_cpus(list(range(12))) is None and up.cpu_shares is not None
    shared = launcher("--tensor-parallel-size", "2", "--no-split-cpus")  # 4 ranks
    assert shared._plan_cpus(list(range(8))) == 2  # not 4: each worker runs 2 ranks
    pinned = launcher("--tensor-parallel-size", "2", "--no-split-cpus", "--torch-threads", "3")
    assert pinned._plan_cpus(list(range(8))) is None
    aggregated = launcher("--prefill-workers", "0", "--decode-tensor-parallel-size", "2")
    assert aggregated._plan_cpus(list(range(4))) is None
    assert aggregated.cpu_shares == [[0, 1, 2, 3]]


def test_a_workers_ranks_get_gpus_of_their_own() -> None:
    gpus = ["0", "1", "2", "3"]
    assert [gpu_for_worker(i, gpus) for i in range(4)] == ["0", "1", "2", "3"]
    assert gpu_for_worker(0, gpus, 2) == "0,1" and gpu_for_worker(2, gpus, 2) == "2,3"
    assert gpu_for_worker(3, gpus, 2) == "3,0"  # past the last GPU: round-robin, still distinct
    assert gpu_for_worker(0, ["0"], 1) is None  # one GPU (or none): the engine decides


# ---- the refusal ---------------------------------------------------------------------------


def test_the_refusal_names_the_role_the_flag_and_the_numbers() -> None:
    engine = EngineConfig(tensor_parallel_size=2)
    assert tp_refusal(UpConfig(), engine, 32, 8, None) is None
    assert tp_refusal(UpConfig(), engine, 9, 3, None) == (
        "prefill workers: 9 attention heads are not divisible by --tensor-parallel-size 2 "
        "(the model has 9 attention heads and 3 KV heads)"
    )
    decode_4 = UpConfig(decode_tensor_parallel_size=4)
    assert tp_refusal(decode_4, EngineConfig(), 32, 2, None) is None  # KV heads replicated
    assert tp_refusal(decode_4, EngineConfig(), 12, 6, None) == (
        "decode workers: 6 KV heads are not divisible by --decode-tensor-parallel-size 4 "
        "(the model has 12 attention heads and 6 KV heads)"
    )
    assert tp_refusal(decode_4, EngineConfig(), 32, 8, 2) == (
        "decode workers: --decode-tensor-parallel-size 4 exceeds the 2 devices available "
        "(the model has 32 attention heads and 8 KV heads)"
    )
    # aggregated serving: no prefill worker, so only the decode size counts
    aggregated = UpConfig(prefill_workers=0, prefill_tensor_parallel_size=5)
    assert tp_refusal(aggregated, EngineConfig(), 32, 8, None) is None


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("pdserve up started a process before refusing")

    monkeypatch.setattr(launcher_module, "spawn", refuse)
    for name in ("NatsServer", "NatsCluster"):
        monkeypatch.setattr(local_nats, name, refuse)


@pytest.mark.usefixtures("nothing_starts")
def test_up_refuses_before_starting_anything(tmp_path: Path, capsys) -> None:
    model = model_dir(tmp_path, heads=9, kv_heads=3)
    argv = ["up", "--model", str(model), "--device", "cpu", "--decode-tensor-parallel-size", "2"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "pdserve up: decode workers: 9 attention heads are not divisible by "
        "--decode-tensor-parallel-size 2 (the model has 9 attention heads and 3 KV heads)\n"
    )


@pytest.mark.usefixtures("nothing_starts")
def test_up_counts_the_gpus_it_may_hand_out(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    up = launcher("--model", str(model_dir(tmp_path, 8, 8)), "--tensor-parallel-size", "2")
    with pytest.raises(StartupError, match="--tensor-parallel-size 2 exceeds the 1 devices"):
        up.start()


def test_each_worker_gets_its_own_disk_tier_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two workers on one directory would each index and evict the other's files; a worker's
    directory is named by its id, so a restarted stack finds its blocks again."""
    started: dict[str, dict[str, str]] = {}
    monkeypatch.setattr(
        launcher_module, "spawn", lambda name, argv, env, cpus=None: started.update({name: env})
    )
    up = launcher("--decode-workers", "2")
    for role, n in up._worker_counts().items():
        for i in range(n):
            up._start_worker(role, i, {"kv_offload_disk": "/var/kv"})
    dirs = {name: env["PDSERVE_KV_OFFLOAD_DISK"] for name, env in started.items()}
    assert dirs == {n: f"/var/kv/{n}" for n in ("prefill-0", "decode-0", "decode-1")}
    up._start_worker("decode", 2, {})
    assert "PDSERVE_KV_OFFLOAD_DISK" not in started["decode-2"]  # no tier: nothing set
