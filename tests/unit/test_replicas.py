"""The replicas' decisions without a cluster: names, bundles, default threads (hand-solved for the
H200 host and a multi-GPU host), a request's weight, and the router's choice by tokens in flight.
The cluster behaviour (placement, node death, restart) is tests/serve/test_scaleout.py's."""
from __future__ import annotations

import pytest

from powerinfer_ray.actors.replicas import (check_fits, default_threads, node_capacity, replica_bundle,
                                           replica_names)
from powerinfer_ray.serve.protocol import GenerationCall
from powerinfer_ray.serve.router import RATE_WINDOW_S, ReplicaState, Router, least_loaded


def test_names_keep_the_single_engine_and_number_replicas():
    assert replica_names("powerinfer-engine", 1) == ["powerinfer-engine"]
    assert replica_names("e", 3) == ["e-0", "e-1", "e-2"]
    with pytest.raises(ValueError, match="replicas=0"):
        replica_names("e", 0)


def test_bundles_hold_a_replicas_members_on_one_node():
    assert replica_bundle("cuda", 7, True) == {"CPU": 8.0, "GPU": 1.0}
    assert replica_bundle("cuda", 7, True, gpus=0.5) == {"CPU": 8.0, "GPU": 0.5}
    assert replica_bundle("cuda", 7, False) == {"CPU": 1.0, "GPU": 1.0}  # no CPU executor: its threads not held
    assert replica_bundle("cpu", 3, True, resource="slot") == {"CPU": 4.0, "slot": 1.0}
    for bad in (0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="replica_gpus"):
            replica_bundle("cuda", 1, True, gpus=bad)


def test_default_threads_share_each_nodes_cpus():
    h200 = {"CPU": 16.0, "GPU": 1.0, "memory": 1e11}
    # one replica on the whole host: 14 threads, as a single engine takes (all cores but two)
    assert default_threads([h200], replica_bundle("cuda", 1, False), 1) == 14
    # two on its one GPU: 15 CPUs (one left over) halved, 7 each, one of them the GPU executor's
    assert default_threads([h200], replica_bundle("cuda", 1, False, gpus=0.5), 2) == 6
    # eight GPUs, 128 cores: one replica per GPU, 127 // 8 - 1
    assert default_threads([{"CPU": 128.0, "GPU": 8.0}], replica_bundle("cuda", 1, False), 8) == 14
    # the smallest node that can host one decides; a node without a GPU hosts none
    nodes = [{"CPU": 32.0, "GPU": 2.0}, {"CPU": 16.0, "GPU": 2.0}, {"CPU": 4.0}]
    assert default_threads(nodes, replica_bundle("cuda", 1, False), 4) == (15 // 2 - 1)
    # a custom resource bounds the replicas per node; at least one thread
    assert default_threads([{"CPU": 4.0, "slot": 2.0}], replica_bundle("cpu", 1, False, resource="slot"), 3) == 1
    with pytest.raises(ValueError, match="no node of the Ray cluster has the resources"):
        default_threads([{"CPU": 64.0}], replica_bundle("cuda", 1, False), 2)


def test_a_bundle_no_node_can_hold_is_refused():
    nodes = [{"CPU": 16.0, "GPU": 1.0}, {"CPU": 4.0}]
    check_fits(nodes, replica_bundle("cuda", 15, True))  # the first node holds it: 16 CPUs, its GPU
    with pytest.raises(ValueError, match=r"a replica needs \{'CPU': 17.0, 'GPU': 1.0\} of one node"):
        check_fits(nodes, replica_bundle("cuda", 16, True))
    with pytest.raises(ValueError, match="slot"):
        check_fits(nodes, replica_bundle("cpu", 1, False, resource="slot"))


def test_node_capacity_counts_bundles_by_their_scarce_resource():
    assert node_capacity({"CPU": 16.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 0.5}) == 2
    assert node_capacity({"CPU": 16.0, "GPU": 3.0, "slot": 2.0}, {"CPU": 1.0, "GPU": 1.0, "slot": 1.0}) == 2
    assert node_capacity({"CPU": 16.0}, {"CPU": 1.0, "GPU": 1.0}) == 0


def test_a_requests_weight_is_its_prompt_and_its_most_new_tokens():
    assert GenerationCall(None, [1, 2, 3], {"max_tokens": 10}).tokens(n_ctx=100) == 13
    assert GenerationCall("x" * 40, None, {"max_tokens": 10}, n=2).tokens(n_ctx=100) == 2 * (11 + 10)
    assert GenerationCall("hi", None, {"max_tokens": None}).tokens(n_ctx=100) == 1 + 99  # chat: the context's rest


def test_least_loaded_takes_ties_in_turn():
    assert least_loaded([5, 3, 3], turn=0) == 1
    assert least_loaded([5, 3, 3], turn=2) == 2
    assert least_loaded([0, 0, 0], turn=1) == 1
    assert least_loaded([None, 7, None], turn=0) == 1
    assert least_loaded([None, None], turn=0) is None


def _router(*states: str) -> Router:
    return Router([ReplicaState(f"r{i}", engine=None, state=s) for i, s in enumerate(states)])


def test_the_router_sends_requests_to_the_fewest_tokens_in_flight():
    router = _router("up", "up", "starting")
    picks = []
    leases = []
    for tokens in (100, 10, 10, 10):  # a long request weighs more than short ones
        r = router.pick()
        leases.append(router.lease(r, tokens))
        picks.append(r.name)
    assert picks == ["r0", "r1", "r1", "r1"]  # r1 holds 30 tokens after three short ones, r0 100
    assert [r.tokens for r in router.replicas] == [100, 30, 0] and router.replicas[1].requests == 3
    leases[0].release()
    leases[0].release()  # once only
    assert router.pick().name == "r0" and router.replicas[0].tokens == 0


def test_the_router_skips_lost_replicas_and_falls_back_when_none_is_up():
    router = _router("up", "up")
    router.lost(router.replicas[0], "gone")
    assert [router.pick().name for _ in range(3)] == ["r1"] * 3
    assert router.pick(exclude={"r1"}).name == "r0"  # none up beside: the down one is still tried
    router.lost(router.replicas[1], "gone")
    assert {router.pick().name for _ in range(2)} == {"r0", "r1"}
    assert router.pick(exclude={"r0", "r1"}) is None


def test_tokens_per_second_over_the_window():
    r = ReplicaState("r", engine=None)
    router = Router([r])
    router.count(r, 50)
    router.count(r, 30)
    assert r.generated_total == 80 and r.tokens_per_s() == pytest.approx(80 / RATE_WINDOW_S)
    assert r.tokens_per_s(now=r.generated[-1][0] + RATE_WINDOW_S + 1) == 0.0
