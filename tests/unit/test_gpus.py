"""A node's GPUs through NVML (toolkit/watch/gpus.py), to the run's metrics. This machine has no GPU
and no NVIDIA driver, so NVML itself cannot run here: it is stood in for by an object answering
pynvml's calls with what an 8-GPU H100 node returns, in NVML's own units and shapes (percent
utilisation, bytes, Celsius, error counts; NVMLError with NVML's codes; an XID event with its
device and code). Everything from those answers on is ft's real code."""

from __future__ import annotations

import queue
import time
from types import SimpleNamespace

from tests.support.run_specs import run_spec, write_run_spec
from toolkit.watch import gpus as gpus_module
from toolkit.watch.gpus import GpuReader, GpuSample
from toolkit.watch.metrics import RunCollector


class NVMLError(Exception):
    def __init__(self, value):
        super().__init__(value)
        self.value = value


class H100Node:
    """pynvml's calls as an H100 node answers them."""

    NVMLError = NVMLError
    NVML_ERROR_TIMEOUT, NVML_ERROR_NOT_SUPPORTED = 10, 3
    NVML_TEMPERATURE_GPU, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC = 0, 1, 0
    nvmlEventTypeXidCriticalError = 8

    def __init__(self, count: int = 8):
        self.count = count
        self.events: queue.Queue = queue.Queue()
        self.registered: list[int] = []

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index):
        return f"handle-{index}"

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=87 if handle != "handle-3" else 0, memory=41)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(total=85_520_809_984, free=20_000_000_000, used=65_520_809_984)

    def nvmlDeviceGetTemperature(self, handle, sensor):
        if handle == "handle-0":
            raise NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return 64

    def nvmlDeviceGetTotalEccErrors(self, handle, error_type, counter):
        return 2 if handle == "handle-5" else 0

    def nvmlEventSetCreate(self):
        return "event-set"

    def nvmlDeviceRegisterEvents(self, handle, types, events):
        self.registered.append(handle)

    def nvmlEventSetWait_v2(self, events, timeout_ms):
        try:
            return self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise NVMLError(self.NVML_ERROR_TIMEOUT) from None

    def nvmlEventSetFree(self, events):
        pass


def test_readings_in_nvmls_units_become_samples(monkeypatch):
    nvml = H100Node()
    reader = GpuReader.open(nvml)
    try:
        samples = reader.read()
    finally:
        reader.close()
    assert len(samples) == 8 and len(nvml.registered) == 8
    first, fourth = samples[0], samples[3]
    assert first.utilization == 0.87 and fourth.utilization == 0.0
    assert first.memory_used == 65_520_809_984 and first.memory_total == 85_520_809_984
    assert first.temperature is None and samples[1].temperature == 64  # not supported: left out
    assert samples[5].ecc_uncorrected == 2 and first.xid_count == 0 and first.last_xid is None


def test_a_critical_xid_is_counted_on_its_gpu(monkeypatch):
    monkeypatch.setattr(gpus_module, "SAMPLE_EVERY_S", 0.0)
    nvml = H100Node()
    reader = GpuReader.open(nvml)
    try:
        nvml.events.put(SimpleNamespace(device="handle-6", eventData=79, eventType=8))
        deadline = time.monotonic() + 10
        while reader.read()[6].xid_count == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        samples = reader.read()
    finally:
        reader.close()
    assert (samples[6].xid_count, samples[6].last_xid) == (1, 79)
    assert all(s.xid_count == 0 for s in samples if s.index != 6)


def test_no_nvml_means_no_gpu_metrics_and_nothing_else():
    class NoDriver(H100Node):
        def nvmlInit(self):
            raise NVMLError(9)  # NVML_ERROR_DRIVER_NOT_LOADED

    assert GpuReader.open(NoDriver()) is None


class Unforeseen(Exception):
    """What nobody foresaw: neither pynvml's NVMLError nor an ImportError names it."""


def test_nvml_failing_unforeseen_as_it_opens_means_no_gpu_metrics_and_nothing_else():
    """gpus.py's blind except in open(): NVML (or the reader's first calls to it) raising what nobody
    foresaw leaves the node without GPU metrics, never fails the launcher (narrowed to OSError, this
    test fails: checked)."""
    class BrokenInit(H100Node):
        def nvmlInit(self):
            raise Unforeseen("the driver broke in a way nobody foresaw")

    class BrokenCount(H100Node):
        def nvmlDeviceGetCount(self):
            raise Unforeseen("the driver broke in a way nobody foresaw")

    assert GpuReader.open(BrokenInit()) is None and GpuReader.open(BrokenCount()) is None


def test_a_reading_that_fails_unforeseen_is_left_out_and_the_others_are_read():
    """gpus.py's blind except in _call(): a reading raising what nobody foresaw (not NVML's
    NOT_SUPPORTED) is left out of that GPU's sample, and every other reading is taken (narrowed to
    OSError, this test fails: checked)."""
    class OneBrokenSensor(H100Node):
        def nvmlDeviceGetTemperature(self, handle, sensor):
            if handle == "handle-2":
                raise Unforeseen("a sensor broke in a way nobody foresaw")
            return super().nvmlDeviceGetTemperature(handle, sensor)

    reader = GpuReader.open(OneBrokenSensor())
    try:
        samples = reader.read()
    finally:
        reader.close()
    assert len(samples) == 8 and samples[2].temperature is None and samples[1].temperature == 64
    assert samples[2].utilization == 0.87 and samples[2].memory_used == 65_520_809_984  # the rest of GPU 2 is read


def test_the_heartbeat_wire_round_trips_and_junk_is_dropped():
    sample = GpuSample(2, 0.5, 1e9, 8e10, 70.0, 0.0, 3, 48)
    assert GpuSample.from_wire(sample.to_wire()) == sample
    huge = [0, 10**400, 1e300, float("nan"), 2.0, 3.0, 10**30, 2**40]  # past any reading: dropped
    assert GpuSample.from_wire(huge) == GpuSample(0, None, None, None, 2.0, 3.0, 0, None)
    for junk in ([], "x", [None] * 8, ["0", 1, 2, 3, 4, 5, 6, 7], [1, "hot", 2, 3, 4, 5, -2, "79"]):
        parsed = GpuSample.from_wire(junk)
        assert parsed is None or (parsed.utilization is None and parsed.xid_count == 0 and parsed.last_xid is None)


def test_the_runs_metrics_carry_each_nodes_gpus(tmp_path):
    write_run_spec(tmp_path, run_spec())
    heartbeats = {"node1": {"gpus": [GpuSample(0, 0.87, 6.5e10, 8.5e10, 64.0, 0.0, 1, 79).to_wire(), ["junk"]]},
                  "node2": {"gpus": "junk"}}
    families = {f.name: f for f in RunCollector(tmp_path, {"run": "r1"}, dict, lambda: heartbeats).collect()}
    value = {name: [(s.labels, s.value) for s in family.samples] for name, family in families.items()}
    assert value["ft_gpu_utilization_ratio"] == [({"run": "r1", "node": "node1", "gpu": "0"}, 0.87)]
    assert value["ft_gpu_xid_errors"][0][1] == 1 and value["ft_gpu_last_xid"][0][1] == 79
    assert value["ft_gpu_temperature_celsius"][0][1] == 64


def test_a_nodes_recorded_nvml_readings_are_replayed_through_the_same_reader(tmp_path, monkeypatch):
    """The lab's nodes have no GPU: each replays NVML's readings from a file (FT_NVML_RECORDED), which
    the reader samples as it would NVML, a changed reading showing at the next sample."""
    import json
    import socket

    node = socket.gethostname().split(".")[0]
    (tmp_path / node).mkdir()
    recorded = tmp_path / node / "nvml.json"
    h100 = {"utilization": 87, "memory_total": 85_520_809_984, "memory_used": 65_520_809_984, "temperature": 64,
            "ecc_uncorrected": 0}
    recorded.write_text(json.dumps({"gpus": [h100, {**h100, "temperature": "hot"}]}))
    monkeypatch.setenv("FT_NVML_RECORDED", str(tmp_path / "{node}" / "nvml.json"))
    monkeypatch.setattr(gpus_module, "SAMPLE_EVERY_S", 0.0)
    reader = GpuReader.open()
    assert reader is not None and reader.events is None  # no XID events from a recording
    first, second = reader.read()
    assert first == GpuSample(0, 0.87, 65_520_809_984.0, 85_520_809_984.0, 64.0, 0.0)
    assert second.temperature is None and second.utilization == 0.87  # a reading NVML would not give: left out
    recorded.write_text(json.dumps({"gpus": [{**h100, "temperature": 91}]}))
    assert [s.temperature for s in reader.read()] == [91.0, None]  # the GPUs are counted once, as NVML does
    recorded.write_text("{not json")
    assert reader.read() == [GpuSample(i, None, None, None, None, None) for i in (0, 1)]  # no readings, no crash
    recorded.unlink()
    monkeypatch.setenv("FT_NVML_RECORDED", str(recorded))
    assert gpus_module.RecordedNvml.for_node() is None  # nothing recorded: NVML itself, where there is one
