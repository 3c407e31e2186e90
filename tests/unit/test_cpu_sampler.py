import pytest

from load_tests.cpu_sampler import cores_by_label, parse_stat, process_label, snapshot


@pytest.mark.parametrize(("comm", "cmdline", "label"), [
    ("ray::ServeRepli", "ray::ServeReplica:llm-lanes:Router.handle_request_with_rejection",
     "ServeReplica:llm-lanes:Router"),
    ("ray::ServeRepli", "ray::ServeReplica:llm-lanes:ColdLane", "ServeReplica:llm-lanes:ColdLane"),
    ("ray::ServeContr", "ray::ServeController.listen_for_change", "ServeController"),
    ("VLLM::EngineCor", "VLLM::EngineCore", "VLLM::EngineCore"),
    ("gcs_server", "/venv/lib/ray/core/src/ray/gcs/gcs_server --flag", "gcs_server"),
])
def test_process_label_names_the_actor_or_the_process(comm, cmdline, label):
    assert process_label(comm, cmdline) == label


def test_parse_stat_reads_comm_with_spaces_and_cpu_seconds():
    import os

    ticks = os.sysconf("SC_CLK_TCK")
    fields = ["S"] + ["0"] * 10 + [str(3 * ticks), str(ticks)] + ["0"] * 30
    comm, cpu_s = parse_stat(f"123 (VLLM::Engine Core) {' '.join(fields)}")
    assert comm == "VLLM::Engine Core" and cpu_s == 4.0


def test_cores_by_label_sums_processes_of_a_label_over_the_window():
    samples = [
        (100.0, {1: ("Router", 10.0), 2: ("VLLM::Worker", 50.0)}),
        (101.0, {1: ("Router", 10.5), 2: ("VLLM::Worker", 50.9), 3: ("Router", 0.0)}),
        (102.0, {1: ("Router", 11.0), 2: ("VLLM::Worker", 51.8), 3: ("Router", 0.4)}),
        (103.0, {1: ("Router", 99.0)}),  # outside the window
    ]
    wall, cores = cores_by_label(samples, 100.0, 102.5)
    assert wall == 2.0
    assert cores == pytest.approx({"VLLM::Worker": 0.9, "Router": 0.7})  # (1.0 + 0.4) / 2 for the two Routers
    assert list(cores) == ["VLLM::Worker", "Router"]  # busiest first
    assert cores_by_label(samples, 102.5, 200) == (0.0, {})


def test_snapshot_sees_this_process():
    import os

    taken = snapshot()
    assert os.getpid() in taken and taken[os.getpid()][1] > 0
