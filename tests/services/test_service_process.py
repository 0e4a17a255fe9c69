"""A model service as its own process: logs what it serves, answers health
checks, and on SIGTERM drains and exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.serving.server import free_port


def test_target_service_process_serves_then_drains_on_sigterm(tiny_pair, tmp_path):
    port = free_port()
    log = open(tmp_path / "service.log", "w+")
    env = {**os.environ, "SPECDEC_TARGET_PORT": str(port), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "target-service", "--model", str(tiny_pair[0]),
         "--host", "127.0.0.1", "--drain-grace", "5"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            deadline = time.time() + 60
            while True:
                assert proc.poll() is None, open(tmp_path / "service.log").read()
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(service="specdec.v1.TargetService"),
                                          timeout=2).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                assert time.time() < deadline, "service did not become SERVING"
                time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = open(tmp_path / "service.log").read()
    assert f"serving target model {tiny_pair[0]}" in text and f"127.0.0.1:{port}" in text
    assert "received SIGTERM" in text and "exited cleanly" in text
    assert "objects alive after start-up frozen" in text  # full collections skip the loaded model
