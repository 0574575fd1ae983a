"""The deploy files, checked without a cluster: the Kubernetes example parses as a LeaderWorkerSet whose leader runs
node 0 with the HTTP front and whose workers run the other nodes, its commands are valid for our own argument
parser, its readiness probe and Service reach the front; the Dockerfile installs the serving and NVSHMEM extras."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from streamfusion_diffusers.cli import make_parser

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
LWS = {"LWS_GROUP_SIZE": "4", "LWS_LEADER_ADDRESS": "streamfusion-0.streamfusion", "LWS_WORKER_INDEX": "3"}


def documents() -> dict[str, dict]:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "leaderworkerset.yaml").read_text()))
    return {doc["kind"]: doc for doc in docs}


def pod_command(template: dict) -> tuple:
    """(the container, launch's options, serve's options) of a pod template, LWS's variables filled in as
    Kubernetes fills $(VAR) from the container's environment."""
    (container,) = template["spec"]["containers"]
    argv = [re.sub(r"\$\((\w+)\)", lambda m: LWS[m[1]], a) for a in container["command"][1:] + container["args"]]
    assert container["command"][0] == "streamfusion"
    parser = make_parser()
    launch = parser.parse_args(argv)
    assert launch.command == "launch" and launch.module and launch.script == "streamfusion_diffusers"
    serve = parser.parse_args(launch.script_args)
    assert serve.command == "serve"
    return container, launch, serve


def test_the_example_is_a_leaderworkerset_of_n_nodes_with_a_service_in_front():
    docs = documents()
    lws = docs["LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    template = lws["spec"]["leaderWorkerTemplate"]
    assert isinstance(template["size"], int) and template["size"] >= 2
    assert {"leaderTemplate", "workerTemplate"} <= template.keys()
    assert template.get("restartPolicy", "None") == "None"  # a lost worker pod restarts alone and rejoins
    service = docs["Service"]
    assert service["apiVersion"] == "v1"
    assert service["spec"]["selector"]["leaderworkerset.sigs.k8s.io/name"] == lws["metadata"]["name"]
    for key, value in service["spec"]["selector"].items():
        if key != "leaderworkerset.sigs.k8s.io/name":
            assert template["leaderTemplate"]["metadata"]["labels"][key] == value  # the leader only


@pytest.mark.parametrize("role", ["leaderTemplate", "workerTemplate"])
def test_each_pod_runs_one_node_of_the_same_job_with_flags_our_cli_takes(role):
    template = documents()["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    container, launch, serve = pod_command(template[role])
    _, leader_launch, leader_serve = pod_command(template["leaderTemplate"])
    assert launch.nnodes == int(LWS["LWS_GROUP_SIZE"])
    assert launch.node_rank == (0 if role == "leaderTemplate" else int(LWS["LWS_WORKER_INDEX"]))
    assert launch.master_addr == LWS["LWS_LEADER_ADDRESS"]
    assert (launch.master_port, launch.nproc_per_node) == (leader_launch.master_port, leader_launch.nproc_per_node)
    assert vars(serve) == vars(leader_serve)  # every node runs the same serve command
    assert container["resources"]["limits"]["nvidia.com/gpu"] == launch.nproc_per_node
    names = {e["name"] for e in container["env"]}
    assert "STREAMFUSION_JOIN_KEY" in names


def test_the_leader_is_ready_on_health_of_the_front_the_service_targets():
    docs = documents()
    container, _, serve = pod_command(docs["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]["leaderTemplate"])
    probe = container["readinessProbe"]["httpGet"]
    assert probe == {"path": "/health", "port": serve.port}
    assert serve.host == "0.0.0.0"
    assert docs["Service"]["spec"]["ports"][0]["targetPort"] == serve.port
    assert "STREAMFUSION_API_KEY" in {e["name"] for e in container["env"]}


def test_the_dockerfile_builds_on_cuda_with_the_serving_and_nvshmem_extras():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM nvidia/cuda:\S+", text, re.M)
    extras = re.search(r'pip install "\.\[([\w,]+)\]"', text)
    assert extras and {"serve", "nvshmem"} <= set(extras[1].split(","))
    assert re.search(r'^ENTRYPOINT \["streamfusion"\]', text, re.M)
