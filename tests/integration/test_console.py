"""The operator's console at /ui, driven in a real headless Chromium over real HTTP: a real
gateway with a synthetic:tiny worker and its own valkey-server: pages, forms, sign-in with
admin tokens and their roles, and the audit of console changes. Screenshots of each page are
written to tests/artifacts/console/, named by page."""

from __future__ import annotations

import html as html_text
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.admin_access import is_mutating
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
    worker behind it; KV residency is recorded every half second."""
    root = tmp_path_factory.mktemp("console")
    store = EmbeddedStore(root / "store")
    store.start()
    data_dir = root / "data"
    worker = WorkerProcess(
        root / "engine.sock",
        [
            *("--model", "synthetic:tiny", "--num-kv-blocks", "64", "--block-size", "4"),
            *("--max-loras", "1", "--max-lora-rank", "8"),
            *("--adapter-dir", str(data_dir / "adapters")),
        ],
        strata_cache_dir,
    )
    worker.start()
    settings = gateway_settings(
        store.url, worker, strata_cache_dir, kv_residency_interval_s=0.5, data_dir=str(data_dir)
    )
    server = GatewayServer(settings)
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


def signed_in_client(
    url: str, token: str = ADMIN_TOKEN, **headers: str
) -> tuple[httpx.Client, str]:
    """An httpx client holding a console session signed in with `token`, and that session's
    CSRF token (read from the page sign-in leads to)."""
    client = httpx.Client(base_url=url, timeout=30, headers=headers)
    signin = client.get("/ui/signin")
    anonymous_csrf = CSRF_INPUT.search(signin.text)
    assert anonymous_csrf is not None
    done = client.post(
        "/ui/signin", data={"token": token, "_csrf": anonymous_csrf.group(1), "next": "/ui"}
    )
    assert done.status_code == 303, done.text
    landing = client.get(done.headers["location"])
    assert landing.status_code == 200
    csrf = CSRF_INPUT.search(landing.text)
    assert csrf is not None
    return client, csrf.group(1)


def new_admin_token(gateway: GatewayServer, role: str) -> tuple[str, str, str]:
    """An admin token of `role` issued through the admin API: (id, name, secret)."""
    name = f"{role}-{uuid.uuid4().hex[:6]}"
    with gateway.admin() as admin:
        made = admin.post("/admin/tokens/", json={"name": name, "role": role})
    assert made.status_code == 201, made.text
    return made.json()["token"]["id"], name, made.json()["secret"]


def audit_entries(gateway: GatewayServer, **params: str) -> list[dict[str, Any]]:
    with gateway.admin() as admin:
        exported = admin.get("/admin/audit/export", params=params)
    assert exported.status_code == 200, exported.text
    return [httpx.Response(200, content=line).json() for line in exported.text.splitlines()]


def nav_titles(html: str) -> list[str]:
    nav = re.search(r'<nav class="sidebar".*?</nav>', html, re.S)
    assert nav is not None
    return [
        html_text.unescape(t.strip()) for t in re.findall(r"<a [^>]*>([^<]+)</a>", nav.group(0))
    ]


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


def test_a_budget_set_in_the_console_is_the_admin_apis_budget(page, console_gateway) -> None:
    tenant_id, _ = console_gateway.new_tenant()
    sign_in(page)
    page.goto(f"/ui/tenants/{tenant_id}")
    assert page.locator("#budget-none").is_visible()
    page.fill("#budget input[name=limit_usd]", "ten dollars")
    page.click("#budget button[type=submit]")
    page.wait_for_selector("#budget .alert.error")
    assert "limit_usd" in page.inner_text("#budget .alert.error")
    assert page.locator("#budget .field.invalid input[name=limit_usd]").count() == 1
    page.fill("#budget input[name=limit_usd]", "25.50")
    page.select_option("#budget select[name=period]", "day")
    page.fill("#budget input[name=thresholds]", "90, 50")
    page.click("#budget button[type=submit]")
    page.wait_for_selector("#budget .alert.ok")
    assert page.inner_text("#budget-limit") == "$25.50"
    assert page.locator("#budget-meter").is_visible()
    with console_gateway.admin() as admin:
        status = admin.get(f"/admin/tenants/{tenant_id}/budget").json()
    assert status["budget"] == {"limit_usd": "25.50", "period": "day", "thresholds": [50, 90]}
    assert status["remaining_usd"] == "25.50"
    shoot(page, "tenant-budget")

    page.get_by_role("button", name="Remove budget").click()
    page.wait_for_selector("#budget-none")
    with console_gateway.admin() as admin:
        assert admin.get(f"/admin/tenants/{tenant_id}/budget").json()["budget"] is None
    assert page.broken == []


def test_key_limits_edited_in_the_console_are_enforced(page, console_gateway) -> None:
    tenant_id, secret = console_gateway.new_tenant()
    with console_gateway.admin() as admin:
        (key,) = admin.get(f"/admin/tenants/{tenant_id}/keys").json()
    sign_in(page)
    page.goto(f"/ui/tenants/{tenant_id}")
    card = f"#key-budget-{key['id']}"
    assert "last used never" in page.inner_text(card)
    page.click(f"{card} summary")
    page.fill(f"{card} .key-limits input[name=rpm]", "0")
    page.click(f"{card} .key-limits button[type=submit]")
    page.wait_for_selector(f"{card} .alert.error")
    assert "rpm" in page.inner_text(f"{card} .alert.error")
    page.fill(f"{card} .key-limits input[name=rpm]", "1")
    page.fill(f"{card} .key-limits input[name=allowed_models]", "default, synthetic:tiny")
    page.click(f"{card} .key-limits button[type=submit]")
    page.wait_for_selector(f"{card} .alert.ok:has-text('Limits saved')")
    page.click(f"{card} summary")
    page.fill(f"{card} .key-budget-form input[name=limit_usd]", "3")
    page.click(f"{card} .key-budget-form button[type=submit]")
    page.wait_for_selector(f"{card} .alert.ok:has-text('Key budget saved')")
    assert "of $3" in page.inner_text(f"{card} .key-budget-figure")

    assert chat(console_gateway.url, secret).status_code == 200
    refused = chat(console_gateway.url, secret)
    assert refused.status_code == 429, refused.text
    with console_gateway.admin() as admin:
        status = admin.get(f"/admin/keys/{key['id']}/status").json()
    assert status["key"]["limits"]["rpm"] == 1
    assert status["key"]["limits"]["allowed_models"] == ["default", "synthetic:tiny"]
    assert status["budget"]["budget"]["limit_usd"] == "3"
    page.reload()
    assert "last used never" not in page.inner_text(card)
    shoot(page, "tenant-keys")
    assert page.broken == []


def test_spend_chart_draws_the_cost_of_priced_requests(page, console_gateway) -> None:
    with console_gateway.admin() as admin:
        price = {"model": "synthetic:tiny", "prompt_per_m": 1000, "completion_per_m": 2000}
        assert admin.put("/admin/prices/", json=price).status_code == 200
        # the tiny model's KV is a few KiB: a price high enough to show in micro-dollars
        assert admin.put("/admin/kv-prices/", json={"device": 1e6}).status_code == 200
    tenant_id, secret = console_gateway.new_tenant()
    for _ in range(2):
        assert chat(console_gateway.url, secret).status_code == 200
    with console_gateway.admin() as admin:
        deadline = time.monotonic() + 30  # the ledger is written just after each response
        while True:
            report = admin.get(f"/admin/tenants/{tenant_id}/spend").json()
            held = admin.get(
                "/admin/kv-residency/", params={"tenant": tenant_id, "format": "json"}
            ).json()
            kv_cost = sum(Decimal(str(r["cost"])) for r in held if r["tier"] == "device")
            done = report["requests"] == 2 and kv_cost > 0
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert report["requests"] == 2
    assert report["cost_nanos"] > 0
    assert kv_cost > 0
    sign_in(page)
    page.locator("nav").get_by_role("link", name="Spend").click()
    page.select_option("#spend-filter select[name=tenant]", tenant_id)
    page.click("#spend-filter button[type=submit]")
    page.wait_for_url(f"**/ui/spend?tenant={tenant_id}**")
    chart = page.locator("#spend-chart")
    chart.locator("canvas").wait_for()
    assert int(chart.get_attribute("data-points") or "0") == 1
    assert page.inner_text("#spend-requests") == f"${report['cost_usd']}"
    cells = page.locator("#spend-rows tbody td:last-child").all_inner_texts()
    assert cells == [report["rows"][0]["cost_usd"]]
    kv_rows = page.locator("#kv-rows tbody tr", has_text="device")
    assert kv_rows.count() == 1
    assert Decimal(kv_rows.locator("td:last-child").inner_text()) > 0
    assert '"device":' in (page.locator("#spend-data").text_content() or "")
    shoot(page, "spend")
    page.goto(f"/ui/spend?tenant={tenant_id}&by=hour")
    page.locator("#spend-chart canvas").wait_for()
    assert page.inner_text("#spend-requests") == f"${report['cost_usd']}"
    assert page.broken == []


def test_kv_prices_are_set_on_the_models_page(page, console_gateway) -> None:
    sign_in(page)
    page.goto("/ui/models")
    page.fill("#kv-prices input[name=host]", "-0.5")
    page.click("#kv-prices button[type=submit]")
    page.wait_for_selector("#kv-prices .alert.error")
    assert "host" in page.inner_text("#kv-prices .alert.error")
    assert page.locator("#kv-prices .field.invalid input[name=host]").count() == 1
    page.fill("#kv-prices input[name=device]", "0.25")
    page.fill("#kv-prices input[name=host]", "0.05")
    page.click("#kv-prices button[type=submit]")
    page.wait_for_selector("#kv-prices .alert.ok")
    with console_gateway.admin() as admin:
        assert admin.get("/admin/kv-prices/").json() == {"device": 0.25, "host": 0.05}
    shoot(page, "models-kv-prices")
    assert page.broken == []


def test_a_viewer_cannot_submit_the_budget_form(console_gateway) -> None:
    tenant_id, _ = console_gateway.new_tenant()
    _, _, secret = new_admin_token(console_gateway, "viewer")
    client, csrf = signed_in_client(console_gateway.url, secret)
    try:
        shown = client.get(f"/ui/tenants/{tenant_id}")
        assert shown.status_code == 200
        assert 'id="budget"' in shown.text
        assert f'hx-post="/ui/tenants/{tenant_id}/budget"' not in shown.text
        refused = client.post(
            f"/ui/tenants/{tenant_id}/budget",
            data={"limit_usd": "5", "_csrf": csrf},
            headers={"hx-request": "true"},
        )
        assert refused.status_code == 403
        assert client.get("/ui/spend").status_code == 200
    finally:
        client.close()
    with console_gateway.admin() as admin:
        assert admin.get(f"/admin/tenants/{tenant_id}/budget").json()["budget"] is None


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
    page.fill("#register input[name=name]", "support-bot")
    page.fill("#register input[name=path]", "/nonexistent/adapter")
    page.click("#register button[type=submit]")
    page.wait_for_selector("#adapters .alert.error")
    assert page.locator("#register .field.invalid input[name=path]").count() == 1
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


def test_a_viewer_token_from_the_store_reads_every_page_but_cannot_write(page, console_gateway):
    token_id, name, secret = new_admin_token(console_gateway, "viewer")
    tenant_id, _ = console_gateway.new_tenant(rpm=100)
    sign_in(page, secret)
    assert page.url.endswith("/ui")
    assert page.inner_text("#who").split() == [name, "viewer"]
    titles = page.locator("nav a").all_inner_texts()
    assert {"Overview", "Tenants", "Usage", "Audit log"} <= set(titles)
    page.locator("nav").get_by_role("link", name="Tenants").click()
    assert page.locator("#tenant-create").count() == 0
    page.goto(f"/ui/tenants/{tenant_id}")
    assert page.locator("#policy fieldset.bare[disabled]").count() == 1
    assert page.get_by_role("button", name="Save policy").count() == 0
    assert page.get_by_role("button", name="Disable").count() == 0
    assert "read-only: your role (viewer)" in page.inner_text("#policy .alert.note").lower()
    shoot(page, "tenant-viewer")
    page.goto(f"/ui/tenants/{tenant_id}/keys")
    assert page.locator("#keys form").count() == 0
    assert page.get_by_text("active", exact=True).is_visible()  # the key is listed
    page.locator("nav").get_by_role("link", name="Models & prices").click()
    assert page.locator("#prices form").count() == 0
    page.locator("nav").get_by_role("link", name="Audit log").click()
    assert page.get_by_role("heading", name="Audit log").is_visible()
    assert page.broken == []

    client, csrf = signed_in_client(console_gateway.url, secret)
    try:
        by_htmx = client.post(
            "/ui/tenants", data={"name": "by-viewer", "_csrf": csrf}, headers={"hx-request": "true"}
        )
        assert by_htmx.status_code == 403
        assert by_htmx.text.startswith('<p class="alert error"')  # in place of the form
        assert "read-only" in by_htmx.text
        plain = client.post(f"/ui/tenants/{tenant_id}/policy", data={"rpm": "1", "_csrf": csrf})
        assert plain.status_code == 403
        assert "Sign out" in plain.text  # a page of the console, still signed in
        assert client.get("/ui/tenants").status_code == 200
    finally:
        client.close()
    with console_gateway.admin() as admin:
        assert "by-viewer" not in [t["name"] for t in admin.get("/admin/tenants/").json()]
        assert admin.get(f"/admin/tenants/{tenant_id}/policy").json()["policy"]["rpm"] == 100
    (refused,) = [e for e in audit_entries(console_gateway, target=tenant_id) if e["status"] == 403]
    assert (refused["actor"], refused["role"]) == (token_id, "viewer")


def test_a_billing_session_sees_usage_and_prices_only(console_gateway):
    _, _, secret = new_admin_token(console_gateway, "billing")
    client, csrf = signed_in_client(console_gateway.url, secret)
    try:
        prices = client.get("/ui/models")
        assert nav_titles(prices.text) == ["Models & prices", "Usage", "Spend"]
        assert 'action="/ui/models/prices"' not in prices.text
        assert 'action="/ui/models/kv-prices"' not in prices.text
        assert client.get("/ui/usage").status_code == 200
        assert client.get("/ui/spend").status_code == 200
        for path in ("/ui", "/ui/tenants", "/ui/adapters", "/ui/audit"):
            refused = client.get(path)
            assert refused.status_code == 403, path
            assert "sees usage, spend and prices only" in refused.text
        price = client.post("/ui/models/prices", data={"model": "default", "_csrf": csrf})
        assert price.status_code == 403
    finally:
        client.close()


def test_a_revoked_tokens_session_is_signed_out_at_its_next_request(page, console_gateway):
    token_id, _, secret = new_admin_token(console_gateway, "admin")
    sign_in(page, secret)
    page.locator("nav").get_by_role("link", name="Tenants").click()
    assert page.url.endswith("/ui/tenants")
    with console_gateway.admin() as admin:
        assert admin.delete(f"/admin/tokens/{token_id}").status_code == 200
    page.reload()
    assert "/ui/signin" in page.url
    assert page.locator("input[name=token]").is_visible()
    sign_in(page, secret)
    assert page.get_by_role("alert").inner_text() == "That admin token is not right."


def test_a_console_change_is_audited_with_the_tokens_id(page, console_gateway):
    token_id, name, secret = new_admin_token(console_gateway, "admin")
    sign_in(page, secret)
    page.locator("nav").get_by_role("link", name="Tenants").click()
    page.fill("#tenant-create input[name=name]", "audited-here")
    page.click("#tenant-create button[type=submit]")
    page.wait_for_url(re.compile(r".*/ui/tenants/[^/]+$"))
    tenant_id = page.url.rsplit("/", 1)[1]

    page.locator("nav").get_by_role("link", name="Audit log").click()
    page.fill("#audit-filter input[name=target]", tenant_id)
    page.click("#audit-filter button[type=submit]")
    page.wait_for_url(f"**/ui/audit?target={tenant_id}")
    rows = page.locator("#audit tbody tr")
    assert rows.count() == 1
    shown = rows.first.inner_text()
    for text in (name, token_id, "admin", "tenants.create", "POST /ui/tenants", tenant_id):
        assert text in shown, text
    assert "127.0.0.1" in shown
    assert rows.first.locator("time").get_attribute("datetime")
    shoot(page, "audit")
    page.fill("#audit-filter input[name=target]", "nothing-about-this")
    page.click("#audit-filter button[type=submit]")
    page.wait_for_selector("text=Nothing recorded about")
    shoot(page, "audit-empty")
    assert page.broken == []

    with console_gateway.admin() as admin:
        found = admin.get("/admin/audit/", params={"target": tenant_id}).json()["data"]
    (entry,) = found
    assert (entry["actor"], entry["role"]) == (token_id, "admin")
    assert (entry["action"], entry["method"], entry["path"]) == (
        "tenants.create",
        "POST",
        "/ui/tenants",
    )
    assert entry["created_id"] == entry["target"] == tenant_id
    assert entry["status"] == 200  # htmx is sent on with HX-Redirect
    assert entry["client"] == "127.0.0.1"
    assert entry["change"]["name"] == "audited-here"
    assert "_csrf" not in entry["change"]


def test_the_audit_page_pages_back_through_older_entries(console_gateway):
    tenant_id, _ = console_gateway.new_tenant()
    with console_gateway.admin() as admin:
        for rpm in range(1, 56):
            changed = admin.patch(f"/admin/tenants/{tenant_id}/policy", json={"rpm": rpm})
            assert changed.status_code == 200
    expected = [e["id"] for e in audit_entries(console_gateway, target=tenant_id)][::-1]
    assert len(expected) == 57  # create, issue a key, 55 changes
    client, _ = signed_in_client(console_gateway.url)
    try:
        shown: list[str] = []
        url = f"/ui/audit?target={tenant_id}"
        num_pages = 0
        while url:
            listed = client.get(url)
            assert listed.status_code == 200
            shown += re.findall(r'<tr id="entry-([0-9-]+)"', listed.text)
            older = re.search(r'href="(/ui/audit\?before=[^"]+)" rel="next"', listed.text)
            url = older.group(1).replace("&amp;", "&") if older else ""
            num_pages += 1
        assert shown == expected  # newest first, each once
        assert num_pages == 2
        bad = client.get("/ui/audit", params={"before": "yesterday"})
        assert bad.status_code == 400
        assert "&#39;before&#39;" in bad.text
    finally:
        client.close()


def test_every_mutating_console_route_writes_an_audit_entry(console_gateway):
    token_id, _, secret = new_admin_token(console_gateway, "admin")
    app = console_gateway.server.config.app
    routes = [
        (method, route.path)
        for route in app.routes
        if route.path.startswith("/ui")
        for handler in route.route_handlers
        if is_mutating(handler)
        for method in sorted(handler.http_methods)
    ]
    assert len(routes) >= 9
    agent = f"console-probe/{uuid.uuid4().hex[:8]}"
    sent = set()
    for method, path in routes:
        client, csrf = signed_in_client(console_gateway.url, secret, **{"user-agent": agent})
        parts = [
            f"probe-{uuid.uuid4().hex[:8]}" if p.startswith("{") else p for p in path.split("/")
        ]
        url = "/".join(parts)
        try:
            answer = client.request(method, url, data={"_csrf": csrf, "token": secret})
        finally:
            client.close()
        sent.add((method, url, answer.status_code))
    recorded = [e for e in audit_entries(console_gateway) if e["user_agent"] == agent]
    assert {e["actor"] for e in recorded} == {token_id}
    assert sent <= {(e["method"], e["path"], e["status"]) for e in recorded}


def test_an_adapter_uploaded_in_the_console_serves_requests(page, console_gateway, tmp_path):
    from engine.model_specs import PRESETS
    from tests.lora_files import write_adapter

    folder = tmp_path / "upload"
    write_adapter(folder, PRESETS["tiny"], rank=4, seed=3)
    sign_in(page)
    page.goto("/ui/adapters")
    page.fill("#upload input[name=name]", "uploaded-bot")
    page.click("#upload button[type=submit]")  # no files chosen: refused in place
    page.wait_for_selector("#adapters .alert.error")
    assert page.locator("#upload .field.invalid input[name=adapter_config]").count() == 1
    page.fill("#upload input[name=name]", "uploaded-bot")
    page.set_input_files("#upload input[name=adapter_config]", folder / "adapter_config.json")
    page.set_input_files("#upload input[name=adapter_model]", folder / "adapter_model.safetensors")
    page.click("#upload button[type=submit]")
    page.wait_for_selector("#adapters .alert.ok")
    assert page.locator("#adapters td", has_text="uploaded-bot").count() == 1
    shoot(page, "adapters-uploaded")
    _, key = console_gateway.new_tenant()
    r = httpx.post(
        f"{console_gateway.url}/v1/completions",
        json={"model": "uploaded-bot", "prompt": "Hello", "max_tokens": 2},
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
