"""The operator's console at /ui, driven in a real headless Chromium over real HTTP: a real
gateway with a synthetic:tiny worker and its own valkey-server. Screenshots of each page are
written to tests/artifacts/console/, named by page."""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tenants.store import EmbeddedStore
from tests.integration.conftest import (
    ADMIN_TOKEN,
    GatewayServer,
    WorkerProcess,
    gateway_settings,
)

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts" / "console"
CSRF_INPUT = re.compile(r'name="_csrf" value="([^"]+)"')


@pytest.fixture(scope="module")
def console_gateway(tmp_path_factory, strata_cache_dir) -> Iterator[GatewayServer]:
    """A gateway of the module's own (so its tenant list starts empty), a synthetic:tiny
    worker behind it."""
    root = tmp_path_factory.mktemp("console")
    store = EmbeddedStore(root / "store")
    store.start()
    worker = WorkerProcess(
        root / "engine.sock",
        ["--model", "synthetic:tiny", "--num-kv-blocks", "64", "--block-size", "4"],
        strata_cache_dir,
    )
    worker.start()
    server = GatewayServer(gateway_settings(store.url, worker, strata_cache_dir))
    server.start()
    yield server
    server.stop()
    worker.stop()
    store.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless Chromium for the module: Debian's `chromium` (make install-dev)."""
    executable = shutil.which("chromium")
    if executable is None:
        pytest.fail("the console tests need Debian's chromium on PATH: run `make install-dev`")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the console tests need the playwright package: run `make install-dev`")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture
def page(browser, console_gateway) -> Iterator[Any]:
    """A fresh browser context (no cookies) with confirmations accepted."""
    context = browser.new_context(
        base_url=console_gateway.url, viewport={"width": 1280, "height": 900}
    )
    tab = context.new_page()
    tab.on("dialog", lambda dialog: dialog.accept())
    tab.broken = []  # scripts that failed, and anything the page's CSP blocked
    tab.on("pageerror", lambda error: tab.broken.append(str(error)))
    tab.on(
        "console",
        lambda message: (
            tab.broken.append(message.text) if "Content Security Policy" in message.text else None
        ),
    )
    yield tab
    context.close()


def shoot(tab: Any, name: str) -> None:
    path = ARTIFACTS / f"{name}.png"
    tab.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")


def sign_in(tab: Any, token: str = ADMIN_TOKEN) -> None:
    tab.goto("/ui/signin")
    tab.fill("input[name=token]", token)
    tab.click("#signin button[type=submit]")
    tab.wait_for_load_state()


def chat(url: str, secret: str) -> httpx.Response:
    body = {
        "model": "default",
        "max_tokens": 3,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Hello"}],
    }
    headers = {"authorization": f"Bearer {secret}"}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)


def signed_in_client(url: str) -> tuple[httpx.Client, str]:
    """An httpx client holding a signed-in console session, and that session's CSRF token."""
    client = httpx.Client(base_url=url, timeout=30)
    signin = client.get("/ui/signin")
    anonymous_csrf = CSRF_INPUT.search(signin.text)
    assert anonymous_csrf is not None
    done = client.post(
        "/ui/signin", data={"token": ADMIN_TOKEN, "_csrf": anonymous_csrf.group(1), "next": "/ui"}
    )
    assert done.status_code == 303, done.text
    overview = client.get("/ui")
    assert overview.status_code == 200
    csrf = CSRF_INPUT.search(overview.text)
    assert csrf is not None
    return client, csrf.group(1)


def test_wrong_token_is_refused_in_place(page) -> None:
    page.goto("/")
    assert page.url.endswith("/ui/signin?next=/ui")
    shoot(page, "signin")
    sign_in(page, token="not-the-admin-token-at-all")
    assert page.get_by_role("alert").inner_text() == "That admin token is not right."
    assert page.locator("input[name=token]").is_visible()
    shoot(page, "signin-refused")
    page.goto("/ui/tenants")
    assert "/ui/signin" in page.url


def test_operator_creates_tenant_and_key_shown_once_then_revoked(page, console_gateway) -> None:
    sign_in(page)
    assert page.url.endswith("/ui")
    assert page.get_by_role("heading", name="Overview").is_visible()
    shoot(page, "overview")

    page.locator("nav").get_by_role("link", name="Tenants").click()
    assert page.get_by_text("No tenants yet — create one").is_visible()
    shoot(page, "tenants-empty")
    page.fill("#tenant-create input[name=name]", "acme corp")  # a space: refused in place
    page.click("#tenant-create button[type=submit]")
    page.wait_for_selector("#tenant-create .alert.error")
    assert "name must be" in page.inner_text("#tenant-create .alert.error")
    page.fill("#tenant-create input[name=name]", "acme-corp")
    page.fill("#tenant-create input[name=id]", "acme")
    page.click("#tenant-create button[type=submit]")
    page.wait_for_url("**/ui/tenants/acme")
    assert page.get_by_role("heading", name="acme-corp").is_visible()
    shoot(page, "tenant")

    page.fill("#policy input[name=rpm]", "-5")
    page.click("#policy button[type=submit]")
    page.wait_for_selector("#policy .alert.error")
    assert "rpm" in page.inner_text("#policy .alert.error")
    assert page.locator("#policy .field.invalid input[name=rpm]").count() == 1
    page.fill("#policy input[name=rpm]", "600")
    page.click("#policy button[type=submit]")
    page.wait_for_selector("#policy .alert.ok")
    with console_gateway.admin() as admin:
        assert admin.get("/admin/tenants/acme/policy").json()["policy"]["rpm"] == 600

    page.get_by_role("link", name="API keys").click()
    assert page.get_by_text("No keys yet — issue one").is_visible()
    page.fill("#keys input[name=name]", "production")
    page.click("#keys form.row button[type=submit]")
    page.wait_for_selector("#secret-value")
    secret = page.inner_text("#secret-value").strip()
    assert secret.startswith("sk-strata-")
    shoot(page, "keys-new-secret")
    assert chat(console_gateway.url, secret).status_code == 200

    page.reload()
    assert page.locator("#secret-value").count() == 0
    assert secret not in page.content()
    assert page.get_by_text("active", exact=True).is_visible()

    page.get_by_role("button", name="Rotate").click()
    page.wait_for_selector("#secret-value")
    successor = page.inner_text("#secret-value").strip()
    assert successor.startswith("sk-strata-")
    assert successor != secret
    assert page.get_by_text("retiring").is_visible()  # the old key works for its grace hour
    assert page.get_by_role("button", name="Rotate").count() == 1  # only the new key's
    assert chat(console_gateway.url, secret).status_code == 200
    assert chat(console_gateway.url, successor).status_code == 200

    page.locator("tr", has_text="active").get_by_role("button", name="Revoke").click()
    page.wait_for_selector("text=revoked")
    shoot(page, "keys-revoked")
    assert chat(console_gateway.url, successor).status_code == 401

    page.locator("nav").get_by_role("link", name="Tenants").click()
    page.fill("input[type=search]", "zzz-nobody")
    page.wait_for_selector("text=No tenant matches")
    page.fill("input[type=search]", "acme")
    page.wait_for_selector("#tenants a:has-text('acme-corp')")
    shoot(page, "tenants")
    assert page.broken == []


def test_usage_chart_draws_requests_from_the_ledger(page, console_gateway) -> None:
    tenant_id, secret = console_gateway.new_tenant()
    num_requests = 3
    for _ in range(num_requests):
        assert chat(console_gateway.url, secret).status_code == 200
    sign_in(page)
    deadline = time.monotonic() + 30  # the ledger is written just after each response
    while True:
        page.goto(f"/ui/usage?tenant={tenant_id}&by=hour")
        shown = int(page.inner_text("#usage-requests").replace(",", ""))
        if shown == num_requests or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert shown == num_requests
    chart = page.locator("#usage-chart")
    chart.locator("canvas").wait_for()
    assert int(chart.get_attribute("data-points") or "0") >= 1
    shoot(page, "usage")
    page.goto(f"/ui/usage?tenant={tenant_id}&by=day")
    page.locator("#usage-chart canvas").wait_for()
    assert int(page.inner_text("#usage-requests")) == num_requests
    assert page.broken == []


def test_other_pages_render_and_refuse_bad_input_in_place(page) -> None:
    sign_in(page)
    page.locator("nav").get_by_role("link", name="Models & prices").click()
    assert page.locator("table code", has_text="synthetic").count() >= 1
    page.fill("#prices input[name=model]", "default")
    page.fill("#prices input[name=prompt_per_m]", "-1")
    page.click("#prices button[type=submit]")
    page.wait_for_selector("#prices .alert.error")
    assert "negative" in page.inner_text("#prices .alert.error")
    page.fill("#prices input[name=prompt_per_m]", "0.15")
    page.fill("#prices input[name=completion_per_m]", "0.6")
    page.click("#prices button[type=submit]")
    page.wait_for_selector("#prices .alert.ok")
    assert page.locator("#prices td code", has_text="default").count() == 1
    shoot(page, "models")

    page.locator("nav").get_by_role("link", name="Adapters").click()
    assert page.get_by_text("No adapters yet — register one").is_visible()
    page.fill("#adapters input[name=name]", "support-bot")
    page.fill("#adapters input[name=path]", "/nonexistent/adapter")
    page.click("#adapters button[type=submit]")
    page.wait_for_selector("#adapters .alert.error")
    assert page.locator("#adapters .field.invalid input[name=path]").count() == 1
    shoot(page, "adapters")

    page.get_by_role("button", name="Sign out").click()
    page.wait_for_url("**/ui/signin")
    page.goto("/ui/adapters")
    assert "/ui/signin" in page.url


def test_form_post_without_csrf_token_is_refused(console_gateway) -> None:
    client, csrf = signed_in_client(console_gateway.url)
    try:
        refused = client.post("/ui/tenants", data={"name": "forged"})
        assert refused.status_code == 403
        wrong = client.post("/ui/tenants", data={"name": "forged", "_csrf": "x" * 43})
        assert wrong.status_code == 403
        by_htmx = client.post(
            "/ui/tenants", data={"name": "forged"}, headers={"hx-request": "true"}
        )
        assert by_htmx.status_code == 403
        assert by_htmx.text.startswith('<p class="alert error"')  # in place of the form
        with console_gateway.admin() as admin:
            names = [t["name"] for t in admin.get("/admin/tenants/").json()]
        assert "forged" not in names
        created = client.post("/ui/tenants", data={"name": "made-here", "_csrf": csrf})
        assert created.status_code == 303
        assert created.headers["location"].startswith("/ui/tenants/")
        by_header = client.post(
            "/ui/tenants", data={"name": "made-by-htmx"}, headers={"x-csrf-token": csrf}
        )
        assert by_header.status_code == 303
        tenant_path = created.headers["location"]
        assert client.post(f"{tenant_path}/status", data={"disabled": "true"}).status_code == 403
        disable = client.post(f"{tenant_path}/status", data={"disabled": "true", "_csrf": csrf})
        assert disable.status_code == 303
        with console_gateway.admin() as admin:
            tenant = admin.get(f"/admin/tenants/{tenant_path.rsplit('/', 1)[1]}").json()
        assert tenant["disabled"] is True
    finally:
        client.close()


def test_session_cookie_is_httponly_and_strict(console_gateway) -> None:
    with httpx.Client(base_url=console_gateway.url, timeout=30) as client:
        root = client.get("/")
        assert root.status_code in (301, 302, 307, 308)
        assert root.headers["location"] == "/ui"
        page_without_session = client.get("/ui/tenants")
        assert page_without_session.status_code == 303
        assert page_without_session.headers["location"] == "/ui/signin?next=/ui/tenants"
        signin = client.get("/ui/signin")
        assert signin.headers["cache-control"] == "no-store"
        assert "frame-ancestors 'none'" in signin.headers["content-security-policy"]
        script = client.get("/ui/static/vendor/htmx/htmx.min.js")
        assert script.status_code == 200
        assert "max-age=3600" in script.headers["cache-control"]
        cookie = signin.headers["set-cookie"].lower()
        assert "httponly" in cookie
        assert "samesite=strict" in cookie
        assert "path=/ui" in cookie
    forged_cookie = {"strata_console": "e30.AAAA"}
    with httpx.Client(base_url=console_gateway.url, cookies=forged_cookie) as forger:
        assert forger.get("/ui").status_code == 303
        assert forger.get("/admin/tenants/").status_code == 401  # bearer auth unchanged


def test_tenant_list_pages_and_searches(console_gateway) -> None:
    with console_gateway.admin() as admin:
        for i in range(23):
            made = admin.post(
                "/admin/tenants/", json={"name": f"paged-{i:02d}", "id": f"paged{i:02d}"}
            )
            assert made.status_code == 201, made.text
    client, _ = signed_in_client(console_gateway.url)
    try:
        first = client.get("/ui/tenants", params={"q": "paged"})
        second = client.get("/ui/tenants", params={"q": "paged", "page": 2})
        assert "Page 1 of 2" in first.text
        assert "Page 2 of 2" in second.text
        shown = [
            set(re.findall(r'href="/ui/tenants/(paged\d\d)"', r.text)) for r in (first, second)
        ]
        assert len(shown[0]) == 20
        assert len(shown[1]) == 3
        assert shown[0] | shown[1] == {f"paged{i:02d}" for i in range(23)}
        assert "paged22" in shown[0]  # newest first
        one = client.get("/ui/tenants", params={"q": "PAGED07"})
        assert set(re.findall(r'href="/ui/tenants/(paged\d\d)"', one.text)) == {"paged07"}
        unknown = client.get("/ui/tenants/nobody-here")
        assert unknown.status_code == 404
        assert "nobody-here" in unknown.text
        bad_period = client.get("/ui/usage", params={"by": "fortnight"})
        assert bad_period.status_code == 400
        message = re.search(r'class="alert error" role="alert">([^<]*)<', bad_period.text)
        assert message is not None
        assert message.group(1).startswith("&#39;by&#39;: "), message.group(1)
        assert "Sign out" in bad_period.text  # still in the console's layout
    finally:
        client.close()
