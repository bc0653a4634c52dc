"""Slurm launch (aligner_ext/launch/slurm.py, scripts/slurm/): node lists, every node's command in a
dry run of a fake 2-node job and of a heterogeneous job with generation servers, fast failures."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from aligner_ext.launch.slurm import LaunchError, expand_nodelist, main

REPO = Path(__file__).resolve().parents[2]
TWO_NODES = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "4"}
HET = {"SLURM_JOB_ID": "43", "SLURM_JOB_NODELIST_HET_GROUP_0": "train[1-2]", "SLURM_JOB_NUM_NODES_HET_GROUP_0": "2",
       "SLURM_GPUS_PER_NODE_HET_GROUP_0": "gpu:8", "SLURM_JOB_NODELIST_HET_GROUP_1": "gen1",
       "SLURM_JOB_NUM_NODES_HET_GROUP_1": "1", "SLURM_GPUS_PER_NODE_HET_GROUP_1": "2"}


@pytest.mark.parametrize("nodelist,hosts", [
    ("node1", ["node1"]),
    ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
    ("a[8-10]b,c[2]", ["a8b", "a9b", "a10b", "c2"]),
])
def test_node_lists_expand(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_a_malformed_node_list_is_an_error():
    with pytest.raises(LaunchError, match="cannot read the Slurm node list"):
        expand_nodelist("gpu[01-x]")


def test_dry_run_of_two_nodes_prints_each_torchrun(capsys):
    assert main(["train", "--dry-run", "--", "model.path=/m", "trainer.run_name=r"], env=TWO_NODES) == 0
    common = ("--nnodes=2 {rank} --nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=gpu07:29500 --rdzv_id=42 "
              "-m aligner_ext train model.path=/m trainer.run_name=r")
    assert capsys.readouterr().out.splitlines() == [
        "[gpu07] torchrun " + common.format(rank="--node_rank=0"),
        "[gpu08] torchrun " + common.format(rank="--node_rank=1"),
    ]


def test_dry_run_of_a_heterogeneous_job_with_servers(capsys):
    assert main(["serve", "--het-group", "1", "--dry-run", "--", "model.path=/m"], env=HET) == 0
    assert capsys.readouterr().out.splitlines() == [
        "[gen1] CUDA_VISIBLE_DEVICES=0 aligner-ext serve serve.host=0.0.0.0 serve.port=8000 "
        "serve.api_key_env=ALIGNER_EXT_API_KEY model.path=/m",
        "[gen1] CUDA_VISIBLE_DEVICES=1 aligner-ext serve serve.host=0.0.0.0 serve.port=8001 "
        "serve.api_key_env=ALIGNER_EXT_API_KEY model.path=/m",
    ]
    assert main(["train", "--het-group", "0", "--servers-het-group", "1", "--dry-run", "--", "model.path=/m"], env=HET) == 0
    lines = capsys.readouterr().out.splitlines()
    remote = ("generator.engine=remote 'generator.remote.urls=[http://gen1:8000,http://gen1:8001]' "
              "generator.remote.weight_sync=distributed generator.remote.weight_sync_address=train1 "
              "generator.remote.weight_sync_port=29600 generator.remote.api_key_env=ALIGNER_EXT_API_KEY model.path=/m")
    assert lines == [f"[train{n}] torchrun --nnodes=2 --node_rank={n - 1} --nproc_per_node=8 --rdzv_backend=c10d "
                     f"--rdzv_endpoint=train1:29500 --rdzv_id=43 -m aligner_ext train {remote}" for n in (1, 2)]


@pytest.mark.parametrize("env,message", [
    ({}, "SLURM_JOB_NODELIST or SLURM_NODELIST is not set"),
    ({**TWO_NODES, "SLURM_NNODES": "3"}, "holds 2 nodes, Slurm says 3: a node is missing"),
    ({k: v for k, v in TWO_NODES.items() if k != "SLURM_GPUS_ON_NODE"}, "the GPUs per node are unknown"),
    ({**TWO_NODES, "SLURMD_NODENAME": "elsewhere"}, "this node ('elsewhere') is not in the train group"),
])
def test_fails_fast_naming_what_is_missing(env, message, capsys):
    assert main(["train", "--", "model.path=/m"], env=env) == 2
    assert message in capsys.readouterr().err


def test_sbatch_scripts_parse_and_dry_run(tmp_path):
    env = {**os.environ, **TWO_NODES, "DRY_RUN": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for script in ("train.sbatch", "train_with_servers.sbatch"):
        subprocess.run(["bash", "-n", REPO / "scripts" / "slurm" / script], check=True)
    out = subprocess.run(["bash", REPO / "scripts" / "slurm" / "train.sbatch", "model.path=/m"], env=env, cwd=REPO,
                         check=True, capture_output=True, text=True).stdout
    assert out.splitlines()[1].startswith("[gpu08] torchrun --nnodes=2 --node_rank=1")
    out = subprocess.run(["bash", REPO / "scripts" / "slurm" / "train_with_servers.sbatch", "model.path=/m"],
                         env={**env, **HET}, cwd=REPO, check=True, capture_output=True, text=True).stdout
    assert len(out.splitlines()) == 4 and "serve.port=8001" in out and "--rdzv_endpoint=train1:29500" in out


def test_servers_are_not_started_without_the_shared_key(capsys):
    server_node = {**HET, "SLURMD_NODENAME": "gen1"}
    assert main(["serve", "--het-group", "1", "--", "model.path=/m"], env=server_node) == 2
    assert "export ALIGNER_EXT_API_KEY" in capsys.readouterr().err
