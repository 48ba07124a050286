"""Work-conserving, fair admission on a real router over loopback sockets, the sim as its
upstream: one key takes far more than the old per-key cap on a region with room; a full
region is shared max-min fairly between keys (by weight) and between a key's end users; a
client token reads only its own subject's streams."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from typing import Any

import httpx

from firstbyte.router.sim.server import sim_server
from firstbyte.router.streams import owner_of
from firstbyte.router.tenancy import Tenants
from tests.router.conftest import API_KEY, OTHER_KEY, RouterFactory, auth

THIRD_KEY = "sk-test-key-0003"


def chat(text: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": "sim-llama-7b",
        "messages": [{"role": "user", "content": text}],
        "stream": True,
        "max_tokens": max_tokens,
        "seed": 3,
    }


def _code(response: httpx.Response) -> str:
    error: dict[str, str] = json.loads(response.content)["error"]
    return error["code"]


async def test_one_key_takes_far_more_than_128_streams_on_a_region_with_room(
    start_router: RouterFactory,
) -> None:
    # Each stream sends 2 tokens, then holds 3 s before the rest: 200 streams of one key
    # from one address are all in flight at once (below the per-address connection cap).
    count = 200
    async with sim_server("h100-7b", faults=["stall:after=2,ms=3000"]) as sim, start_router(
        [sim.url], tls=False
    ) as router:
        tenants = router.app.state.tenants
        limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
        async with httpx.AsyncClient(limits=limits, timeout=60) as client:
            url = router.base_url + "/v1/chat/completions"
            heads = 0
            all_in = asyncio.Event()

            async def one(i: int) -> tuple[int, bytes]:
                nonlocal heads
                async with client.stream("POST", url, json=chat(f"one {i}", 6),
                                         headers=auth()) as answer:
                    heads += 1
                    if heads == count:
                        all_in.set()
                    return answer.status_code, await answer.aread()

            tasks = [asyncio.create_task(one(i)) for i in range(count)]
            await asyncio.wait_for(all_in.wait(), 30)
            peak = tenants.keys.in_flight(owner_of(API_KEY))
            answers = await asyncio.gather(*tasks)
    statuses = Counter(status for status, _ in answers)
    assert statuses == {200: count}, statuses
    assert all(body.endswith(b"data: [DONE]\n\n") for _, body in answers)
    assert peak == count  # every one of them was in flight at once


Answers = dict[tuple[str, str | None], list[httpx.Response]]


async def _closed_loops(
    url: str, duration_s: float, clients: dict[tuple[str, str | None], int],
    tenants: Tenants | None = None,
) -> tuple[Answers, dict[str, float], dict[tuple[str, str | None], int]]:
    """Each (key, subject) runs its clients in closed loops for ``duration_s``: a new request
    as soon as one ends, 50 ms after a 429 (greedy: not waiting out Retry-After). Returns
    the answers; with ``tenants``, each key's mean requests in flight at the router after
    the first second (sampled every 10 ms); and each one's requests served that were sent
    after the first second, the window of those samples. The first second is left out of
    both: the loops start in order, so the first keys' requests fill an empty region before
    the others' arrive, and the more so the slower the machine."""
    answers: Answers = {k: [] for k in clients}
    served: dict[tuple[str, str | None], int] = dict.fromkeys(clients, 0)
    total = sum(clients.values())
    limits = httpx.Limits(max_connections=total, max_keepalive_connections=total)
    start = time.monotonic()
    deadline = start + duration_s
    keys = {key for key, _ in clients}
    samples: dict[str, list[int]] = {key: [] for key in keys}
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:

        async def loop(key: str, subject: str | None, i: int) -> None:
            n = 0
            while time.monotonic() < deadline:
                sent_at = time.monotonic()
                answer = await client.post(url, json=chat(f"{subject} {i} {n}", 12),
                                           headers=_subject_header(key, subject))
                answers[(key, subject)].append(answer)
                if answer.status_code == 200 and sent_at > start + 1.0:
                    served[(key, subject)] += 1
                n += 1
                if answer.status_code == 429:
                    await asyncio.sleep(0.05)

        async def sample() -> None:
            assert tenants is not None
            while time.monotonic() < deadline:
                if time.monotonic() > start + 1.0:
                    for key in keys:
                        samples[key].append(tenants.keys.in_flight(owner_of(key)))
                await asyncio.sleep(0.01)

        await asyncio.gather(
            *(loop(key, subject, i) for (key, subject), n in clients.items() for i in range(n)),
            *((sample(),) if tenants is not None else ()),
        )
    means = {key: sum(v) / len(v) for key, v in samples.items() if v}
    return answers, means, served


def _subject_header(key: str, subject: str | None) -> dict[str, str]:
    headers = auth(key)
    if subject is not None:
        headers["x-firstbyte-subject"] = subject
    return headers


def _served(answers: list[httpx.Response]) -> int:
    return sum(1 for a in answers if a.status_code == 200)


async def test_a_full_region_is_shared_max_min_fairly_between_keys_asking_1_1_8(
    start_router: RouterFactory,
) -> None:
    # Room for 6 at once; the keys ask for 1, 1 and 8: max-min fair is 1, 1 and 4.
    async with sim_server("h100-7b") as sim, start_router(
        [sim.url], tls=False, upstreams=[{"url": sim.url, "max_in_flight": 6}],
        auth={"api_keys": [API_KEY, OTHER_KEY, THIRD_KEY]},
    ) as router:
        answers, held, served = await _closed_loops(
            router.base_url + "/v1/chat/completions", 4.0,
            {(API_KEY, None): 1, (OTHER_KEY, None): 1, (THIRD_KEY, None): 8},
            router.app.state.tenants,
        )
    light_a, light_b, heavy = (answers[(k, None)] for k in (API_KEY, OTHER_KEY, THIRD_KEY))
    # The light keys, below their share, are never refused; the heavy key is, with its code.
    assert Counter(a.status_code for a in light_a + light_b) == {200: len(light_a + light_b)}
    refused = [a for a in heavy if a.status_code == 429]
    assert refused, "the heavy key asked for more than the region has: it was held"
    # Its own code; "region full" only at a moment no other key was asking.
    codes = Counter(_code(a) for a in refused)
    assert set(codes) <= {"key_over_fair_share", "region_saturated"}, codes
    assert codes["key_over_fair_share"] > codes["region_saturated"], codes
    assert all(int(a.headers["retry-after"]) >= 1 for a in refused)
    # Shares held: 4 slots for the heavy key to each light key's 1 (within 15%), and what
    # they served (equal lengths) in about that ratio. A light key's one client holds its
    # slot but for the gap between a stream's end and its next request's admission, which is
    # the machine's speed, not the router's fairness (0.81-0.85 under five busy processes on
    # two cores; never refused, above): its floor is lower than the heavy key's margin.
    assert 3.4 <= held[THIRD_KEY] <= 4.6, held
    assert all(0.75 <= held[k] <= 1.0 for k in (API_KEY, OTHER_KEY)), held
    a, b, c = (served[(k, None)] for k in (API_KEY, OTHER_KEY, THIRD_KEY))
    assert 3.0 <= c / ((a + b) / 2) <= 5.0, (a, b, c)


async def test_weights_1_1_2_are_honoured_in_a_full_region(start_router: RouterFactory) -> None:
    # Room for 8; three greedy keys, the third with weight 2: 2, 2 and 4 at once.
    async with sim_server("h100-7b") as sim, start_router(
        [sim.url], tls=False, upstreams=[{"url": sim.url, "max_in_flight": 8}],
        auth={"api_keys": [API_KEY, OTHER_KEY], "keys": [{"key": THIRD_KEY, "weight": 2.0}]},
    ) as router:
        answers, held, served = await _closed_loops(
            router.base_url + "/v1/chat/completions", 4.0,
            {(API_KEY, None): 8, (OTHER_KEY, None): 8, (THIRD_KEY, None): 8},
            router.app.state.tenants,
        )
    # Shares of what was held: about 1/4, 1/4 and 1/2; served in about that ratio. Shares,
    # not counts: how full the closed loops keep the region between a stream's end and the
    # next admission is the machine's speed (6.6 of 8 held on a slow one), not the router's
    # fairness. Nor a band around 1/4: a light key's client takes a slot the weight-2 key
    # freed while that key's next request is still on its way (the region has room: work
    # conserving), and the slower the machine the wider that window: 0.25 / 0.25 / 0.50 on a
    # quiet machine, 0.32 / 0.25 / 0.43 on a loaded CI one. So: the weight-2 key holds more
    # than each weight-1 key by at least 30% (ideally twice; weights ignored, as much).
    in_flight = sum(held.values())
    assert in_flight >= 4, held  # contended: more asked than the region's 8 hold
    shares = {key: count / in_flight for key, count in held.items()}
    assert all(shares[THIRD_KEY] >= 1.3 * shares[k] for k in (API_KEY, OTHER_KEY)), held
    assert 0.40 <= shares[THIRD_KEY] <= 0.60, held
    a, b, c = (served[(k, None)] for k in (API_KEY, OTHER_KEY, THIRD_KEY))
    assert 0.7 <= a / b <= 1.4, (a, b, c)
    assert 1.3 <= c / ((a + b) / 2) <= 2.6, (a, b, c)
    codes = Counter(_code(r) for k in answers for r in answers[k] if r.status_code == 429)
    assert set(codes) <= {"key_over_fair_share", "region_saturated"}, codes
    assert codes["key_over_fair_share"] > codes["region_saturated"], codes


async def test_one_abusive_subject_does_not_starve_its_keys_other_subjects(
    start_router: RouterFactory,
) -> None:
    # One key, room for 6: the app's backend names its end users; one of them opens 12
    # streams in closed loops, three others one each. Each of the three gets its share.
    async with sim_server("h100-7b") as sim, start_router(
        [sim.url], tls=False, upstreams=[{"url": sim.url, "max_in_flight": 6}],
    ) as router:
        answers, _, _ = await _closed_loops(
            router.base_url + "/v1/chat/completions", 4.0,
            {(API_KEY, "abuser"): 12, (API_KEY, "u1"): 1, (API_KEY, "u2"): 1,
             (API_KEY, "u3"): 1},
        )
    polite = [a for s in ("u1", "u2", "u3") for a in answers[(API_KEY, s)]]
    assert Counter(a.status_code for a in polite) == {200: len(polite)}
    assert all(_served(answers[(API_KEY, s)]) >= 3 for s in ("u1", "u2", "u3"))
    abuser = answers[(API_KEY, "abuser")]
    refused = [a for a in abuser if a.status_code == 429]
    codes = Counter(_code(a) for a in refused)  # "region full" when it alone was asking
    assert set(codes) <= {"subject_over_fair_share", "region_saturated"}, codes
    assert codes["subject_over_fair_share"] > codes["region_saturated"], codes


async def test_token_subjects_share_the_key_and_read_only_their_own_streams(
    start_router: RouterFactory,
) -> None:
    async with sim_server("h100-7b") as sim, start_router(
        [sim.url], tls=False, upstreams=[{"url": sim.url, "max_in_flight": 4}],
    ) as router:
        base = router.base_url
        async with httpx.AsyncClient(timeout=60) as client:

            async def mint(subject: str, **more: Any) -> str:
                answer = await client.post(base + "/v1/edge/tokens", headers=auth(),
                                           json={"subject": subject, **more})
                assert answer.status_code == 200, answer.text
                token: str = answer.json()["token"]
                return token

            alice, bob = await mint("alice"), await mint("bob", max_streams=1)
            started = await client.post(base + "/v1/streams", json=chat("alice's", 4),
                                        headers=auth(alice))
            assert started.status_code == 201, started.text
            stream = started.json()["stream"]
            mine = await client.get(f"{base}/v1/streams/{stream}", headers=auth(alice))
            theirs = await client.get(f"{base}/v1/streams/{stream}", headers=auth(bob))
            by_key = await client.get(f"{base}/v1/streams/{stream}", headers=auth())
            # Bob's token carries his own cap: a second stream in flight is refused.
            held = await client.post(base + "/v1/streams", json={**chat("bob's", 4)},
                                     headers=auth(bob))
            assert held.status_code == 201
            second = await client.post(base + "/v1/streams", json=chat("bob's 2", 4),
                                       headers=auth(bob))
            # A subject in a request by token is the token's: a header cannot change it.
            spoofed = await client.get(
                f"{base}/v1/streams/{stream}",
                headers={**auth(bob), "x-firstbyte-subject": "alice"},
            )
    assert mine.status_code == 200
    assert mine.content.endswith(b"data: [DONE]\n\n")
    assert by_key.status_code == 200  # the app's key reads all its users' streams
    assert theirs.status_code == 404
    assert _code(theirs) == "stream_not_found"
    assert spoofed.status_code == 404
    assert second.status_code == 429
    assert _code(second) == "subject_concurrency_exceeded"
    assert int(second.headers["retry-after"]) >= 1


async def test_a_user_beside_an_abuser_on_a_full_region_waits_its_turn_within_the_limit(
    start_router: RouterFactory,
) -> None:
    # One key, room for 4 (the sim runs 4 at once and queues the rest): one end user holds
    # 12 closed-loop streams and fills the region; then two light users stream one request
    # after another. A light user's request is below its share: it waits in the router for
    # the next slot that frees (before the abuser's next request), never refused and never
    # sent past the backend's limit to wait in the sim's queue behind the abuser's.
    capacity = 4
    async with sim_server("h100-7b", max_num_seqs=capacity) as sim, start_router(
        [sim.url], tls=False, upstreams=[{"url": sim.url, "max_in_flight": capacity}],
        routing={"backend_max_waiting": 0},
    ) as router:
        tracker = router.app.state.routing.tracker
        url = router.base_url + "/v1/chat/completions"
        peak = 0
        stop = asyncio.Event()

        async def sample() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, tracker.in_flight())
                await asyncio.sleep(0.005)

        sampler = asyncio.create_task(sample())
        abuse = asyncio.create_task(_closed_loops(url, 5.0, {(API_KEY, "abuser"): 12}))
        for _ in range(200):  # the abuser fills the region first (bounded: 2 s)
            if tracker.in_flight() >= capacity:
                break
            await asyncio.sleep(0.01)
        assert tracker.in_flight() >= capacity
        users, _, _ = await _closed_loops(url, 3.0, {(API_KEY, "u1"): 1, (API_KEY, "u2"): 1})
        abuser, _, _ = await abuse
        stop.set()
        await sampler
    light = users[(API_KEY, "u1")] + users[(API_KEY, "u2")]
    assert Counter(a.status_code for a in light) == {200: len(light)}
    assert all(_served(users[(API_KEY, s)]) >= 3 for s in ("u1", "u2"))
    assert all(a.content.endswith(b"data: [DONE]\n\n") for a in light)
    # Nothing went past the backend's limit (the old path queued the users' requests there).
    assert peak <= capacity, peak
    refused = Counter(_code(a) for a in abuser[(API_KEY, "abuser")] if a.status_code == 429)
    assert refused["subject_over_fair_share"] > 0, refused


async def test_a_wait_for_a_slot_is_bounded_by_max_fair_wait_ms(
    start_router: RouterFactory,
) -> None:
    # Room for 2, both held by one end user's streams that stall 3 s after their first
    # tokens: another user's request (below its share) waits for a slot, and when none frees
    # within routing.max_fair_wait_ms (0.4 s) it gets the full region's 429, not a hang.
    async with sim_server("h100-7b", faults=["stall:after=2,ms=3000"]) as sim, start_router(
        [sim.url], tls=False, upstreams=[{"url": sim.url, "max_in_flight": 2}],
        routing={"backend_max_waiting": 0, "max_fair_wait_ms": 400},
    ) as router:
        tracker = router.app.state.routing.tracker
        url = router.base_url + "/v1/chat/completions"
        async with httpx.AsyncClient(timeout=30) as client:
            heads = asyncio.Queue[int]()

            async def hold(i: int) -> None:
                async with client.stream("POST", url, json=chat(f"hold {i}", 6),
                                         headers=_subject_header(API_KEY, "abuser")) as answer:
                    await heads.put(answer.status_code)
                    await answer.aread()

            holders = [asyncio.create_task(hold(i)) for i in range(2)]
            assert [await asyncio.wait_for(heads.get(), 10) for _ in range(2)] == [200, 200]
            assert tracker.in_flight() == 2
            started = time.monotonic()
            light = asyncio.create_task(client.post(url, json=chat("light", 6),
                                                    headers=_subject_header(API_KEY, "light")))
            gauge = "firstbyte_router_requests_waiting_for_slot"
            seen = ""
            for _ in range(30):  # it waits: the gauge says so (bounded: 0.3 s)
                seen = (await client.get(router.base_url + "/metrics", headers=auth())).text
                if f"\n{gauge} 1" in seen:
                    break
                await asyncio.sleep(0.01)
            answer = await light
            waited = time.monotonic() - started
            assert tracker.in_flight() <= 2
            after = (await client.get(router.base_url + "/metrics", headers=auth())).text
            await asyncio.gather(*holders)
    assert f"\n{gauge} 1" in seen
    assert f"\n{gauge} 0" in after
    assert 'firstbyte_route_rejections_total{reason="fair_wait",model="sim-llama-7b"} 1' in after
    assert answer.status_code == 429, answer.text
    assert _code(answer) == "region_saturated"
    assert int(answer.headers["retry-after"]) >= 1
    assert "max_fair_wait_ms" in json.loads(answer.content)["error"]["message"]
    assert 0.4 <= waited < 2.5, waited  # it waited its bound, not for the stall (3 s)


async def test_a_client_that_leaves_while_waiting_gives_up_its_place(
    start_router: RouterFactory,
) -> None:
    # Room for 2, held by one end user's stalled streams; another user's request waits for
    # a slot, then its client goes away: its place and its demand go at once (not when a slot
    # frees or the bound passes), and no upstream request is made for it.
    async with sim_server("h100-7b", faults=["stall:after=2,ms=3000"]) as sim, start_router(
        [sim.url], tls=False, upstreams=[{"url": sim.url, "max_in_flight": 2}],
        routing={"backend_max_waiting": 0, "max_fair_wait_ms": 10000},
    ) as router:
        state = router.app.state
        tracker = state.routing.tracker
        url = router.base_url + "/v1/chat/completions"
        async with httpx.AsyncClient(timeout=30) as client:
            heads = asyncio.Queue[int]()

            async def hold(i: int) -> None:
                async with client.stream("POST", url, json=chat(f"hold {i}", 6),
                                         headers=_subject_header(API_KEY, "abuser")) as answer:
                    await heads.put(answer.status_code)
                    await answer.aread()

            holders = [asyncio.create_task(hold(i)) for i in range(2)]
            assert [await asyncio.wait_for(heads.get(), 10) for _ in range(2)] == [200, 200]
            async with httpx.AsyncClient(timeout=30) as leaving:
                light = asyncio.create_task(leaving.post(
                    url, json=chat("light", 6), headers=_subject_header(API_KEY, "light")))
                for _ in range(100):  # bounded: 1 s
                    if len(state.tenants.queue):
                        break
                    await asyncio.sleep(0.01)
                assert len(state.tenants.queue) == 1
                light.cancel()
            left = time.monotonic()
            for _ in range(150):  # bounded: 1.5 s, well before the stall (3 s) ends
                if not len(state.tenants.queue):
                    break
                await asyncio.sleep(0.01)
            gone_after = time.monotonic() - left
            light_demand = state.tenants.keys.waiting(owner_of(API_KEY))
            requests = sum(b.requests for b in tracker.backends.values())
            await asyncio.gather(*holders)
    assert gone_after < 1.5, gone_after
    assert light_demand == 0
    assert requests == 2  # the two held streams only
