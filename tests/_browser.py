"""A real headless browser for the tests: Chromium driven over the DevTools protocol.

Chromium started with ``--remote-debugging-pipe`` reads protocol commands from its file
descriptor 3 and writes replies and events to 4, each a JSON object ended by a NUL byte;
no websocket, no package beyond the standard library. `Browser.load` opens a page, waits
for its load event and collects what a person would see in the console: messages logged
as errors, uncaught exceptions, and resources that failed to load.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import signal
import time
from pathlib import Path
from typing import Any

NAMES = ("chromium", "chromium-browser", "google-chrome")
TIMEOUT = 120.0
"""Seconds to wait for one reply (the suite shares two cores)."""


def _above_four(fd: int) -> int:
    """A copy of ``fd`` numbered 5 or more (``fd`` is closed): moved onto 3 and 4 in the
    child, neither can be the other's target."""
    copy = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 5)
    os.close(fd)
    return copy


def find_chromium() -> str | None:
    """The Chromium executable on PATH, if any."""
    return next((found for name in NAMES if (found := shutil.which(name))), None)


class Browser:
    """One headless Chromium process; use as a context manager."""

    def __init__(self, executable: str, profile: Path) -> None:
        to_browser, self._commands = os.pipe()
        self._replies, from_browser = os.pipe()
        to_browser, from_browser = (_above_four(fd) for fd in (to_browser, from_browser))
        arguments = [
            executable, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--disable-extensions", "--remote-debugging-pipe",
            f"--user-data-dir={profile}", "about:blank",
        ]  # fmt: skip
        # posix_spawn puts the two pipe ends on descriptors 3 and 4 in the child only.
        self.pid = os.posix_spawn(
            executable,
            arguments,
            os.environ,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, to_browser, 3),
                (os.POSIX_SPAWN_DUP2, from_browser, 4),
                (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
            ],
        )
        os.close(to_browser)
        os.close(from_browser)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.send("Browser.close")
            exited = self._exited(30.0)
        except (OSError, TimeoutError, EOFError, RuntimeError):
            exited = False
        finally:
            os.close(self._commands)
            os.close(self._replies)
        if not exited:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)

    def _exited(self, seconds: float) -> bool:
        """Whether the browser exited (and was reaped) within ``seconds``."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if os.waitpid(self.pid, os.WNOHANG)[0]:
                return True
            time.sleep(0.1)
        return False

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        """Send one command and return its result (raises on a protocol error)."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        reply = self._wait(lambda m: m.get("id") == self._next_id)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def _wait(self, wanted) -> dict:
        deadline = time.monotonic() + TIMEOUT
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                message = json.loads(raw)
                if wanted(message):
                    return message
                self.events.append(message)
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._replies], [], [], left)[0]:
                raise TimeoutError(f"chromium sent nothing wanted in {TIMEOUT} s")
            chunk = os.read(self._replies, 1 << 16)
            if not chunk:
                raise EOFError("chromium closed its pipe")
            self._buffer += chunk

    def load(self, url: str) -> Page:
        """A new tab showing ``url``, once its load event has fired (images included)."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        attached = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})
        session = attached["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            self.send(f"{domain}.enable", session=session)
        self.send("Page.navigate", {"url": url}, session=session)
        self._wait(lambda m: m.get("method") == "Page.loadEventFired")
        return Page(self, session)


class Page:
    """A loaded tab: evaluate JavaScript in it, read what its console reported."""

    def __init__(self, browser: Browser, session: str) -> None:
        self.browser = browser
        self.session = session

    def evaluate(self, expression: str) -> Any:
        """The JSON value of ``expression`` in the page."""
        result = self.browser.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
            session=self.session,
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:60]}...: {result['exceptionDetails']}")
        return result["result"].get("value")

    def console_errors(self) -> list[str]:
        """Console errors and warnings, uncaught exceptions, resources that failed to load."""
        found = []
        for event in self.browser.events:
            if event.get("sessionId") != self.session:
                continue
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.consoleAPICalled" and params["type"] in (
                "error", "assert", "warning"
            ):  # fmt: skip
                texts = [str(a.get("value", a.get("description"))) for a in params["args"]]
                found.append(f"console.{params['type']}: {' '.join(texts)}")
            elif method == "Runtime.exceptionThrown":
                found.append(f"exception: {params['exceptionDetails'].get('text')}")
            elif method == "Log.entryAdded" and params["entry"]["level"] in ("error", "warning"):
                entry = params["entry"]
                found.append(
                    f"{entry['source']} {entry['level']}: {entry['text']} {entry.get('url', '')}"
                )
        return found
