"""A stand-in for W&B's server, on loopback: no W&B server can run here, and the tests may reach
nothing off the machine. It answers what the real wandb client asks while syncing an offline run
(GraphQL UpsertBucket and CreateRunFiles, the run's file stream, the files' uploads; an artifact's
CreateArtifact, CreateArtifactFiles, CreateArtifactManifest and CommitArtifact, as wandb 0.31's
wandb-core sends them) with the smallest answers the client accepts, and records every request and
every upload's bytes for the test to read."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeWandb:
    def __init__(self, refuse: bool = False):
        self.refuse = refuse  # every request answered 401, as W&B does a wrong key
        self.requests: list[dict] = []
        self.uploads: dict[str, bytes] = {}  # what each PUT carried, by path (the newest)
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def answer(self, payload: dict) -> None:
                if fake.refuse:
                    payload = {"errors": [{"message": "user is not logged in"}]}
                data = json.dumps(payload).encode()
                self.send_response(401 if fake.refuse else 200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                raw = self.body()
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    body = {"raw": raw[:2000].decode(errors="replace")}
                with fake.lock:
                    fake.requests.append({"method": "POST", "path": self.path, "body": body})
                self.answer(fake.graphql(body) if self.path.endswith("/graphql") else {"exitcode": None, "limits": {}})

            def do_PUT(self):
                data = self.body()
                with fake.lock:
                    fake.requests.append({"method": "PUT", "path": self.path, "body": None})
                    fake.uploads[self.path] = data
                self.answer({})

            def do_GET(self):
                self.answer({})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def graphql(self, body: dict) -> dict:
        query = body.get("query", "") if isinstance(body, dict) else ""
        variables = body.get("variables") or {}
        if "upsertBucket" in query:
            name = variables.get("name") or "run"
            return {"data": {"upsertBucket": {"inserted": True, "bucket": {
                "id": f"id-{name}", "name": name, "displayName": variables.get("displayName") or name,
                "description": None, "config": variables.get("config"), "sweepName": None,
                "project": {"id": "p1", "name": variables.get("project") or "ft", "entity": {"id": "e1", "name": "me"}},
                "historyLineCount": 0}}}}
        if "createRunFiles" in query:
            return {"data": {"createRunFiles": {"runID": "id-run", "uploadHeaders": [], "files": [
                {"name": name, "uploadUrl": f"{self.url}/upload/{name}"} for name in variables.get("files", [])]}}}
        if "createArtifact(" in query:
            return {"data": {"createArtifact": {"artifact": {
                "id": "artifact-1", "state": "PENDING", "artifactSequence": {"latestArtifact": None}}}}}
        if "createArtifactManifest(" in query:
            return {"data": {"createArtifactManifest": {"artifactManifest": {
                "id": "manifest-1", "file": {"id": "manifest-file-1", "uploadUrl": f"{self.url}/upload/manifest",
                                             "uploadHeaders": []}}}}}
        if "createArtifactFiles(" in query:
            files = (variables.get("input") or {}).get("artifactFiles") or []
            return {"data": {"createArtifactFiles": {"files": {"edges": [{"node": {
                "storagePath": f"artifacts/{file['name']}", "uploadUrl": f"{self.url}/upload/artifact/{file['name']}",
                "uploadHeaders": [], "uploadMultipartUrls": None, "artifact": {"id": file["artifactID"]}}}
                for file in files]}}}}
        if "commitArtifact(" in query:
            return {"data": {"commitArtifact": {"artifact": {"id": variables.get("artifactID"), "digest": ""}}}}
        return {"data": {}}

    def upserts(self) -> list[dict]:
        return [r["body"].get("variables", {}) for r in self.requests
                if r["path"].endswith("/graphql") and "upsertBucket" in r["body"].get("query", "")]

    def streamed(self, file: str) -> list[dict]:
        """The lines the client streamed of one of the run's files (wandb-history.jsonl: the metrics)."""
        lines = []
        for request in self.requests:
            if request["path"].endswith("/file_stream"):
                content = (request["body"].get("files") or {}).get(file, {}).get("content", [])
                lines += [json.loads(line) for line in content]
        return lines

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
