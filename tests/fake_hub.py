"""A local stand-in for the Hugging Face Hub's HTTP API, for tests (the Hub
cannot be reached from them): the endpoints `HfApi.create_repo`,
`upload_folder` (answering "regular" upload mode, so that files arrive inline
in the commit) and `snapshot_download` call, over an in-memory store of
model repos. Point huggingface_hub at it with HF_ENDPOINT=`hub.url`.

    with FakeHub() as hub:
        ...
        hub.files("owner/name")  # {path: bytes} at main

Every request is kept in `hub.requests` as (method, path, Authorization
header), so that a test can check what was called and with which token.
"""
from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict] = {}  # repo id -> {"commits": {oid: {path: bytes}}, "refs": {name: oid}}
        self.requests: list[tuple[str, str, str | None]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def files(self, repo: str, revision: str = "main") -> dict[str, bytes]:
        r = self.repos[repo]
        return r["commits"][r["refs"].get(revision, revision)]

    def commits(self, repo: str) -> list[str]:
        return list(self.repos[repo]["commits"])

    # ---- the API

    def resolve(self, repo: str, revision: str) -> str | None:
        r = self.repos.get(repo)
        if r is None:
            return None
        oid = r["refs"].get(revision, revision)
        return oid if oid in r["commits"] else None

    def commit(self, repo: str, revision: str, lines: list[dict]) -> str:
        r = self.repos[repo]
        parent = r["refs"].get(revision)
        files = dict(r["commits"][parent]) if parent else {}
        for line in lines:
            if line["key"] == "file":
                value = line["value"]
                assert value["encoding"] == "base64", value
                files[value["path"]] = base64.b64decode(value["content"])
            elif line["key"] != "header":
                raise AssertionError(f"the fake hub takes inline files only, got {line['key']}")
        oid = hashlib.sha1(repr((parent, sorted(files.items()))).encode()).hexdigest()
        r["commits"][oid] = files
        r["refs"][revision] = oid
        return oid


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _json(self, status: int, value, extra: dict | None = None):
            self._send(status, json.dumps(value).encode(), {"Content-Type": "application/json", **(extra or {})})

        def _not_found(self, what: str):
            self._json(404, {"error": f"{what} not found"}, {"X-Error-Code": "RepoNotFound"})

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _record(self) -> list[str]:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Authorization")))
            return path.strip("/").split("/")

        def do_POST(self):
            parts = self._record()
            body = self._body()
            if parts[:3] == ["api", "repos", "create"]:
                req = json.loads(body)
                repo = f"{req['organization']}/{req['name']}"
                if repo in hub.repos:
                    return self._json(409, {"error": "You already created this model repo", "url": repo})
                hub.repos[repo] = {"commits": {}, "refs": {}}
                return self._json(200, {"url": f"{hub.url}/{repo}", "name": repo})
            if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("preupload", "commit"):
                repo, action, revision = f"{parts[2]}/{parts[3]}", parts[4], "/".join(parts[5:])
                if repo not in hub.repos:
                    return self._not_found(repo)
                if action == "preupload":
                    files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                             for f in json.loads(body)["files"]]
                    return self._json(200, {"files": files, "commitOid": hub.resolve(repo, revision)})
                lines = [json.loads(line) for line in body.splitlines() if line.strip()]
                oid = hub.commit(repo, revision, lines)
                return self._json(200, {"commitUrl": f"{hub.url}/{repo}/commit/{oid}", "commitOid": oid,
                                        "success": True})
            self._not_found(self.path)

        def do_GET(self, head: bool = False):
            parts = self._record()
            if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
                repo, revision = f"{parts[2]}/{parts[3]}", parts[5]
                oid = hub.resolve(repo, revision)
                if oid is None:
                    return self._not_found(f"{repo}@{revision}")
                files = hub.repos[repo]["commits"][oid]
                if parts[4] == "revision":
                    return self._json(200, {"id": repo, "modelId": repo, "sha": oid, "private": False,
                                            "siblings": [{"rfilename": p} for p in sorted(files)]})
                return self._json(200, [{"type": "file", "path": p, "size": len(b),
                                         "oid": hashlib.sha1(b).hexdigest()} for p, b in sorted(files.items())])
            if len(parts) >= 5 and parts[2] == "resolve":
                repo, revision, path = f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:])
                oid = hub.resolve(repo, revision)
                if oid is None or path not in hub.repos[repo]["commits"][oid]:
                    return self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, head)
                data = hub.repos[repo]["commits"][oid][path]
                return self._send(200, data, {"X-Repo-Commit": oid, "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                                              "Content-Type": "application/octet-stream"}, head)
            self._not_found(self.path)

        def do_HEAD(self):
            self.do_GET(head=True)

    return Handler
