"""A stand-in for the few Hugging Face Hub endpoints `huggingface_hub` 2.x calls for
`create_repo`, `upload_folder` (validate-yaml, preupload, commit), `snapshot_download`
(repo info, tree) and `hf_hub_download` (resolve, HEAD then GET). In memory, on 127.0.0.1.

Every upload is answered "regular" at preupload, so files travel base64 inside the commit
(no LFS, no Xet). Errors carry the `X-Error-Code` header the client maps to its exceptions.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


def git_blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class Store:
    def __init__(self):
        self.repos: dict[str, dict] = {}  # repo -> {"refs": {name: sha}, "commits": {sha: files}}
        self.lock = threading.Lock()
        self.requests: list[str] = []

    def commit(self, repo: str, branch: str, changes: dict[str, bytes]) -> str:
        r = self.repos[repo]
        files = dict(r["commits"].get(r["refs"].get(branch), {}))
        files.update(changes)
        digest = hashlib.sha1(repr(sorted((p, git_blob_sha(b)) for p, b in files.items())).encode())
        digest.update(str(len(r["commits"])).encode())
        sha = digest.hexdigest()
        r["commits"][sha] = files
        r["refs"][branch] = sha
        return sha

    def files(self, repo: str, rev: str) -> tuple[str, dict] | None:
        r = self.repos[repo]
        sha = r["refs"].get(rev, rev)
        return (sha, r["commits"][sha]) if sha in r["commits"] else None


def make_handler(store: Store):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        # -- helpers --------------------------------------------------------------------
        def _send(self, code, body=b"", headers=None, head=False):
            if isinstance(body, dict | list):
                body = json.dumps(body).encode()
                headers = {"Content-Type": "application/json", **(headers or {})}
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _error(self, code, error_code, message, head=False):
            self._send(code, {"error": message},
                       {"X-Error-Code": error_code, "X-Error-Message": message}, head)  # fmt: skip

        def _body(self) -> bytes:
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def _base(self):
            return f"http://{self.headers['Host']}"

        def _route(self, method):
            path = unquote(urlsplit(self.path).path)
            store.requests.append(f"{method} {path}")
            return path

        # -- endpoints ------------------------------------------------------------------
        def do_POST(self):
            path = self._route("POST")
            body = self._body()
            if path == "/api/repos/create":
                d = json.loads(body)
                repo = f"{d['organization']}/{d['name']}"
                with store.lock:
                    store.repos.setdefault(repo, {"refs": {}, "commits": {}})
                return self._send(200, {"url": f"{self._base()}/{repo}"})
            if path == "/api/validate-yaml":
                return self._send(200, {})
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(preupload|commit)/(.+)", path)
            if not m:
                return self._error(404, "NotFound", f"no route {path}")
            repo, what, rev = m.groups()
            if repo not in store.repos:
                return self._error(404, "RepoNotFound", f"{repo} not found")
            if what == "preupload":
                files = json.loads(body)["files"]
                return self._send(200, {"files": [
                    {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                    for f in files]})  # fmt: skip
            changes = {}
            for line in body.splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    v = item["value"]
                    changes[v["path"]] = base64.b64decode(v["content"])
                elif item["key"] != "header":
                    return self._error(400, "BadRequest", f"unsupported {item['key']}")
            with store.lock:
                sha = store.commit(repo, rev, changes)
            return self._send(200, {"commitUrl": f"{self._base()}/{repo}/commit/{sha}",
                                    "commitOid": sha})  # fmt: skip

        def do_HEAD(self):
            self.do_GET(head=True)

        def do_GET(self, head=False):
            path = self._route("HEAD" if head else "GET")
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
            if m:
                repo, rev = m.group(1), m.group(2) or "main"
                if repo not in store.repos:
                    return self._error(404, "RepoNotFound", f"{repo} not found", head)
                got = store.files(repo, rev)
                if got is None:
                    return self._error(404, "RevisionNotFound", f"{rev} not found", head)
                sha, files = got
                return self._send(200, {"id": repo, "sha": sha,
                                        "siblings": [{"rfilename": p} for p in sorted(files)]},
                                  head=head)  # fmt: skip
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?", path)
            if m:
                repo, rev = m.group(1), m.group(2)
                got = store.files(repo, rev) if repo in store.repos else None
                if got is None:
                    return self._error(404, "RevisionNotFound", f"{rev} not found", head)
                _, files = got
                return self._send(200, [
                    {"type": "file", "path": p, "size": len(b), "oid": git_blob_sha(b)}
                    for p, b in sorted(files.items())], head=head)  # fmt: skip
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if m:
                repo, rev, name = m.groups()
                if repo not in store.repos:
                    return self._error(404, "RepoNotFound", f"{repo} not found", head)
                got = store.files(repo, rev)
                if got is None:
                    return self._error(404, "RevisionNotFound", f"{rev} not found", head)
                sha, files = got
                if name not in files:
                    return self._error(404, "EntryNotFound", f"{name} not found", head)
                data = files[name]
                return self._send(200, data, {"X-Repo-Commit": sha,
                                              "ETag": f'"{git_blob_sha(data)}"'}, head)  # fmt: skip
            return self._error(404, "NotFound", f"no route {path}", head)

    return Handler


class HubStandIn:
    """`with HubStandIn() as hub:` serves on `hub.url` until the block ends."""

    def __init__(self):
        self.store = Store()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(self.store))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self):
        if self.thread.is_alive():
            self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
