"""Check the demo's HTML report in a real headless browser (Chromium), as a reader would open it.

A tiny client of the Chrome DevTools Protocol over `--remote-debugging-pipe` (commands as JSON
terminated by a NUL byte on fd 3, answers on fd 4): no websocket library, no port. It opens the
page, waits for the load to complete, and reports every image's natural size, every link and
whether its target exists, and a screenshot. `python -m tests.report_check report.html`
prints the result and exits 1 on a broken image or link.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomguard import children

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")

# Runs in the page: images, links, and whether each in-page anchor has its element.
PROBE = """JSON.stringify({
  title: document.title,
  images: [...document.images].map(i => ({alt: i.alt, complete: i.complete,
    width: i.naturalWidth, height: i.naturalHeight, data: i.src.startsWith('data:')})),
  links: [...document.querySelectorAll('a[href]')].map(a => {
    const href = a.getAttribute('href');
    const inPage = href.startsWith('#');
    return {href, inPage, found: inPage ? !!document.getElementById(href.slice(1)) : null};
  }),
  external: [...document.querySelectorAll('[src],link[href],script[src]')]
    .map(e => e.getAttribute('src') || e.getAttribute('href'))
    .filter(u => u && !u.startsWith('data:') && !u.startsWith('#')),
})"""


def find_browser() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class PageCheck:
    title: str = ""
    images: list[dict[str, Any]] = field(default_factory=list)
    links: list[dict[str, Any]] = field(default_factory=list)
    external: list[str] = field(default_factory=list)  # resources not inlined in the page
    screenshot: bytes = b""

    @property
    def broken_images(self) -> list[dict[str, Any]]:
        return [i for i in self.images if not i["complete"] or i["width"] <= 0]

    @property
    def broken_links(self) -> list[dict[str, Any]]:
        return [link for link in self.links if not link["ok"]]


class Browser:
    """Headless Chromium driven over the DevTools pipe; one page at a time."""

    def __init__(self, binary: str | None = None, timeout: float = 60.0) -> None:
        binary = binary or find_browser()
        if binary is None:
            raise FileNotFoundError("no Chromium found (apt-get install chromium)")
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="oomguard-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def wire() -> None:  # in the child: its fd 3 reads our commands, fd 4 writes answers
            # copies first, so that one pipe end sitting on fd 3 or 4 is not overwritten
            read_end, write_end = os.dup(to_browser_r), os.dup(from_browser_w)
            os.dup2(read_end, 3)
            os.dup2(write_end, 4)

        self.proc = children.popen(  # never outlives this process (children.py)
            [
                binary,
                "--headless",
                "--no-sandbox",  # root in a container has no user namespace to sandbox with
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--remote-debugging-pipe",
                f"--user-data-dir={self.profile}",
                "about:blank",
            ],
            pass_fds=(3, 4),  # kept open through exec (Popen closes the rest after wire())
            preexec_fn=wire,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._next = 0
        self._buffer = b""

    def send(self, method: str, params: dict[str, Any] | None = None, session: str = "") -> Any:
        self._next += 1
        message: dict[str, Any] = {"id": self._next, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            while b"\0" not in self._buffer:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no answer to {method} within {self.timeout} s")
                chunk = os.read(self._from_browser, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"the browser closed the pipe during {method}")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            answer = json.loads(raw)
            if answer.get("id") == self._next:  # events and other answers are skipped
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer.get("result", {})

    def check(self, page: Path, width: int = 1280, height: int = 2000) -> PageCheck:
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"
        ]
        self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
            session,
        )
        url = page.resolve().as_uri()
        self.send("Page.navigate", {"url": url}, session)
        deadline = time.monotonic() + self.timeout
        while True:
            state = self.send(
                "Runtime.evaluate",
                {"expression": "location.href + ' ' + document.readyState", "returnByValue": True},
                session,
            )["result"]["value"]
            if state == f"{url} complete":
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{page} did not finish loading: {state}")
            time.sleep(0.1)
        probe = self.send("Runtime.evaluate", {"expression": PROBE, "returnByValue": True}, session)
        data = json.loads(probe["result"]["value"])
        links = []
        for link in data["links"]:
            href = link["href"]
            if link["inPage"]:
                ok = bool(link["found"])
            elif href.startswith(("http://", "https://", "mailto:")):
                ok = False  # the page promises to be self-contained
            else:
                ok = (page.parent / href.split("#", 1)[0]).exists()
            links.append({**link, "ok": ok})
        shot = self.send("Page.captureScreenshot", {"format": "png"}, session)
        return PageCheck(
            title=data["title"],
            images=data["images"],
            links=links,
            external=data["external"],
            screenshot=base64.b64decode(shot["data"]),
        )

    def close(self) -> None:
        with contextlib.suppress(OSError, RuntimeError, TimeoutError):
            self.send("Browser.close")
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(5)
        for fd in (self._to_browser, self._from_browser):
            with contextlib.suppress(OSError):
                os.close(fd)
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1:
        print("usage: python -m tests.report_check REPORT.html", file=sys.stderr)
        return 2
    page = Path(args[0])
    with Browser() as browser:
        result = browser.check(page)
    shot = page.with_name(page.stem + "-screenshot.png")
    shot.write_bytes(result.screenshot)
    print(
        f"{page}: {len(result.images)} images ({len(result.broken_images)} broken), "
        f"{len(result.links)} links ({len(result.broken_links)} broken), "
        f"{len(result.external)} external resources; screenshot {shot}"
    )
    return 1 if result.broken_images or result.broken_links or result.external else 0


if __name__ == "__main__":
    sys.exit(main())
