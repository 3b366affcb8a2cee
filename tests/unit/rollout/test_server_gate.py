"""The engine server's weights-version gate (rollout/server/gate.py) without a web framework: an update goes on top of
the version before it only, once; a change waits for weight reads and drained generations (an in-flight change only
for reads); a generation waits for its version and gives up past its wait; weights of another run are read at once
when asked; a change cut short leaves the weights unknown and the gate free. The routes around it:
test_server_routes.py."""

import asyncio

import pytest

from lightning_logra.rollout.protocol import Label
from lightning_logra.rollout.server.gate import VersionGate


async def _update(gate: VersionGate, label: Label, in_flight: bool = False) -> bool:
    async with gate.change(label, in_flight, on_top=True) as admitted:
        if admitted:
            gate.forget()
            await asyncio.sleep(0)
            gate.relabel(label)
        return admitted


def test_an_update_goes_on_top_of_the_version_before_it_once():
    async def run():
        gate = VersionGate()
        assert gate.label() == Label(None, 0) and gate.follows(Label("r", 1)) and not gate.follows(Label("r", 2))
        both = await asyncio.gather(_update(gate, Label("r", 1)), _update(gate, Label("r", 1)))
        assert sorted(both) == [False, True] and gate.label() == Label("r", 1)  # two of one version: one change
        assert not await _update(gate, Label("another run", 2)) and await _update(gate, Label("r", 2))
        return gate.label()

    assert asyncio.run(run()) == Label("r", 2)


@pytest.mark.parametrize("in_flight", [False, True])
def test_a_change_waits_for_reads_and_for_generations_unless_in_flight(in_flight):
    async def run():
        gate, order = VersionGate(), []

        async def hold(enter, name: str) -> None:
            async with enter as reached:
                assert reached
                order.append(f"{name} in")
                await asyncio.sleep(0.05)
                order.append(f"{name} out")

        async def change() -> None:
            await asyncio.sleep(0.01)  # once the generation and the read are under way
            async with gate.change(Label("r", 1), in_flight) as admitted:
                assert admitted
                order.append("change")

        await asyncio.gather(hold(gate.generation("r", 0, 1.0), "generation"), change())
        await asyncio.gather(hold(gate.reading("r", 0, 1.0), "read"), change())
        return order

    order = asyncio.run(run())
    if in_flight:  # between two decoding steps of the generation; never inside a read
        assert order == ["generation in", "change", "generation out", "read in", "read out", "change"]
    else:
        assert order == ["generation in", "generation out", "change", "read in", "read out", "change"]


def test_a_generation_waits_for_its_version_or_gives_up():
    async def run():
        gate = VersionGate()
        async with gate.generation("r", 1, 0.05) as reached:
            assert not reached  # at version 0 past its wait: the route answers 409 with the label

        async def later_update() -> None:
            await asyncio.sleep(0.02)
            assert await _update(gate, Label("r", 1))

        async def generation() -> int | None:
            async with gate.generation("r", 1, 5.0) as reached:
                assert reached
                return gate.version

        _, version = await asyncio.gather(later_update(), generation())
        return version

    assert asyncio.run(run()) == 1


def test_weights_of_another_run_are_read_at_once_when_asked():
    async def run():
        gate = VersionGate()
        gate.relabel(Label("another run", 7))
        async with gate.reading("r", 3, 0.0, any_run=True) as reached:
            assert reached  # a comparison finds them different
        async with gate.reading("r", 3, 0.01) as reached:
            assert not reached
        async with gate.generation("r", 3, 0.01) as reached:
            assert not reached

    asyncio.run(run())


def test_a_change_cut_short_leaves_the_weights_unknown_and_the_gate_free():
    async def run():
        gate = VersionGate()
        with pytest.raises(RuntimeError, match="the worker failed"):
            async with gate.change(Label("r", 1), on_top=True) as admitted:
                assert admitted
                gate.forget()
                raise RuntimeError("the worker failed")
        assert gate.label() == Label(None, None) and not gate.follows(Label("r", 1))  # a full load first
        async with gate.change(Label("r", 5)) as admitted:  # a load: not on top of anything
            assert admitted
            gate.relabel(Label("r", 5))
        async with gate.generation("r", 5, 0.0) as reached:
            assert reached
        return gate.label()

    assert asyncio.run(run()) == Label("r", 5)


def test_the_label_is_read_once_a_change_under_way_has_ended():
    # Mid-change the label is the unknown one; a trainer that read it there gave up on a server merging its update.
    async def run():
        gate, seen = VersionGate(), []

        async def slow_update() -> None:
            async with gate.change(Label("r", 1), on_top=True) as admitted:
                assert admitted
                gate.forget()
                await asyncio.sleep(0.05)
                gate.relabel(Label("r", 1))

        async def state() -> None:
            await asyncio.sleep(0.01)  # the update is under way
            assert not await gate.settled(0.0)  # past its wait: the route answers 503
            assert await gate.settled(1.0)
            seen.append(gate.label())

        await asyncio.gather(slow_update(), state())
        assert await gate.settled(0.0)  # nothing under way: at once
        return seen

    assert asyncio.run(run()) == [Label("r", 1)]
