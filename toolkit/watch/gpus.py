"""A node's GPUs through NVML (nvidia-ml-py's pynvml), read by the node's launcher and carried to the
supervisor in its heartbeats (a few hundred bytes), which serves them with the run's metrics:

    ft_gpu_utilization_ratio{node, gpu}          busy share of the last sample period (0-1)
    ft_gpu_memory_used_bytes, _total_bytes        device memory
    ft_gpu_temperature_celsius                    the GPU die
    ft_gpu_ecc_uncorrected_errors_total           volatile (since the driver loaded)
    ft_gpu_xid_errors_total                       critical XID events seen by this launcher
    ft_gpu_last_xid                               the code of the newest one (79: fallen off the bus)

Where NVML cannot start (no GPU, no driver: this machine) there are no GPU metrics, and nothing else
changes. What the metrics say is tested against NVML's own answers, recorded in NVML's units
(tests/unit/test_gpus.py), through the same calls. A node may also replay NVML's answers recorded
in a file (FT_NVML_RECORDED, `{node}` standing for the node's name; `RecordedNvml`): the lab does,
so that GPU metrics, dashboards and alerts run end to end on a machine without a GPU."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

MAX_READING = 1e18  # beyond any GPU's bytes or counts: a heartbeat's value past it is not a reading
SAMPLE_EVERY_S = 5.0  # NVML calls cost milliseconds each: not at every heartbeat (1 s)
XID_WAIT_MS = 1000


@dataclass(frozen=True)
class GpuSample:
    index: int
    utilization: float | None  # 0-1
    memory_used: float | None  # bytes
    memory_total: float | None
    temperature: float | None  # Celsius
    ecc_uncorrected: float | None
    xid_count: int = 0
    last_xid: int | None = None

    def to_wire(self) -> list:
        return [self.index, self.utilization, self.memory_used, self.memory_total, self.temperature,
                self.ecc_uncorrected, self.xid_count, self.last_xid]

    @classmethod
    def from_wire(cls, fields) -> GpuSample | None:
        """One GPU from a heartbeat; None for anything that is not what a launcher sends."""
        if not isinstance(fields, list) or len(fields) != 8 or type(fields[0]) is not int:
            return None
        numbers = [f if isinstance(f, int | float) and not isinstance(f, bool) and abs(f) < MAX_READING else None
                   for f in fields[1:6]]
        numbers = [f if f is None or f == f else None for f in numbers]  # NaN
        xids = fields[6] if type(fields[6]) is int and 0 <= fields[6] < MAX_READING else 0
        last = fields[7] if type(fields[7]) is int and 0 <= fields[7] < 1 << 32 else None
        return cls(fields[0], *numbers, xids, last)


class GpuReader:
    """The node's GPUs, sampled at most every SAMPLE_EVERY_S; critical XID events counted by a
    thread waiting on NVML's event set (where the driver supports it)."""

    def __init__(self, nvml):
        self.nvml = nvml
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        self.lock = threading.Lock()
        self.xids: dict[int, tuple[int, int]] = {}  # gpu index -> (count, last code)
        self.sampled: tuple[float, list[GpuSample]] = (float("-inf"), [])
        self.stopped = threading.Event()
        self.events = self._register_xids()
        if self.events is not None:
            threading.Thread(target=self._watch_xids, name="ft-gpu-xid", daemon=True).start()

    @classmethod
    def open(cls, nvml=None) -> GpuReader | None:
        try:
            if nvml is None:
                nvml = RecordedNvml.for_node()
            if nvml is None:
                import pynvml as nvml
            nvml.nvmlInit()
            return cls(nvml)
        except Exception:  # noqa: BLE001 - no pynvml, no driver, no GPU: a node without GPU metrics
            return None

    def _call(self, function, *args):
        try:
            return function(*args)
        except Exception:  # noqa: BLE001 - NVML_ERROR_NOT_SUPPORTED and the like: that reading is left out
            return None

    def _register_xids(self):
        nvml = self.nvml
        events = self._call(nvml.nvmlEventSetCreate)
        if events is None:
            return None
        registered = 0
        for handle in self.handles:
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
                registered += 1
            except nvml.NVMLError:  # a GPU (or a driver) without XID events
                continue
        if not registered:
            self._call(nvml.nvmlEventSetFree, events)
            return None
        return events

    def _watch_xids(self) -> None:
        nvml = self.nvml
        while not self.stopped.is_set():
            try:
                event = nvml.nvmlEventSetWait_v2(self.events, XID_WAIT_MS)
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) == getattr(nvml, "NVML_ERROR_TIMEOUT", None):
                    continue
                return  # the driver stopped answering: the health check's business now
            index = next((i for i, handle in enumerate(self.handles) if handle == event.device), -1)
            with self.lock:
                count, _ = self.xids.get(index, (0, None))
                self.xids[index] = (count + 1, int(event.eventData))

    def read(self) -> list[GpuSample]:
        taken, samples = self.sampled
        if time.monotonic() - taken < SAMPLE_EVERY_S:
            return samples
        nvml, samples = self.nvml, []
        for index, handle in enumerate(self.handles):
            rates = self._call(nvml.nvmlDeviceGetUtilizationRates, handle)
            memory = self._call(nvml.nvmlDeviceGetMemoryInfo, handle)
            temperature = self._call(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)
            ecc = self._call(nvml.nvmlDeviceGetTotalEccErrors, handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                             nvml.NVML_VOLATILE_ECC)
            with self.lock:
                count, last = self.xids.get(index, (0, None))
            samples.append(GpuSample(index, rates.gpu / 100 if rates is not None else None,
                                     float(memory.used) if memory is not None else None,
                                     float(memory.total) if memory is not None else None,
                                     float(temperature) if temperature is not None else None,
                                     float(ecc) if ecc is not None else None, count, last))
        self.sampled = (time.monotonic(), samples)
        return samples

    def wire(self) -> list[list]:
        return [sample.to_wire() for sample in self.read()]

    def close(self) -> None:
        self.stopped.set()


class RecordedNvml:
    """pynvml's calls answered from NVML's readings recorded in a file, in NVML's units:

        {"gpus": [{"utilization": 87, "memory_total": 85520809984, "memory_used": 65520809984,
                   "temperature": 64, "ecc_uncorrected": 0}, ...]}

    read again whenever the file changes (a changed reading shows at the next sample). No XID events:
    the node's health check reads those from its kernel log."""

    class NVMLError(Exception):
        def __init__(self, value: int):
            super().__init__(f"NVML error {value}")
            self.value = value

    NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_TIMEOUT = 3, 10
    NVML_TEMPERATURE_GPU, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC = 0, 1, 0
    nvmlEventTypeXidCriticalError = 8

    def __init__(self, path: Path):
        self.path = path
        self.parsed: tuple[tuple | None, list] = (None, [])  # (the file's stat, its GPUs)

    @classmethod
    def for_node(cls) -> RecordedNvml | None:
        """The node's recording, where FT_NVML_RECORDED names one that exists."""
        pattern = os.environ.get("FT_NVML_RECORDED", "")
        path = Path(pattern.replace("{node}", socket.gethostname().split(".")[0])) if pattern else None
        return cls(path) if path is not None and path.is_file() else None

    def _gpus(self) -> list:
        """The recorded GPUs, parsed again only when the file changed (a sample asks for each
        reading of each GPU)."""
        try:
            info = self.path.stat()
            seen = (info.st_mtime_ns, info.st_size, info.st_ino)
            if seen != self.parsed[0]:
                gpus = json.loads(self.path.read_text())["gpus"]
                self.parsed = (seen, gpus if isinstance(gpus, list) else [])
        except (OSError, ValueError, KeyError, TypeError):
            raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED) from None
        return self.parsed[1]

    def _gpu(self, handle: int) -> dict:
        gpus = self._gpus()
        if handle >= len(gpus):
            raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return gpus[handle] if isinstance(gpus[handle], dict) else {}

    def _reading(self, handle: int, name: str) -> float:
        value = self._gpu(handle).get(name)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return value

    def nvmlInit(self) -> None:
        self.nvmlDeviceGetCount()

    def nvmlDeviceGetCount(self) -> int:
        return len(self._gpus())

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUtilizationRates(self, handle: int):
        return SimpleNamespace(gpu=self._reading(handle, "utilization"), memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: int):
        total, used = self._reading(handle, "memory_total"), self._reading(handle, "memory_used")
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> float:
        return self._reading(handle, "temperature")

    def nvmlDeviceGetTotalEccErrors(self, handle: int, error_type: int, counter: int) -> float:
        return self._reading(handle, "ecc_uncorrected")

    def nvmlEventSetCreate(self):
        raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
