"""The pieces of the ZenFlow update ([Note: zenflow]) on their own: per-column norms and masks of a weight cut at
any element (a ZeRO partition boundary falls mid-row), the ``"auto"`` interval rule and the selection schedule."""

from __future__ import annotations

import pytest
import torch

from deepspeed._core.config.plan import ZenFlowPolicy
from deepspeed._core.optim.zenflow import ZenFlowUpdate
from deepspeed._core.optim.zenflow_schedule import AutoInterval
from deepspeed._core.optim.zenflow_split import ColumnPiece, ColumnSplit, column_sq


def column_pattern(selected: torch.Tensor, first: int, numel: int) -> torch.Tensor:
    """Reference for the tests: the ``numel`` mask values of elements ``first..`` of a row-major weight whose
    columns ``selected`` are set."""
    cols = selected.numel()
    start = first % cols
    head = min(numel, (cols - start) % cols)
    rows = (numel - head) // cols
    tail = numel - head - rows * cols
    return torch.cat([selected[start : start + head], selected.repeat(rows), selected[:tail]])


def test_column_sums_and_masks_of_a_weight_cut_mid_row() -> None:
    weight = torch.randn(7, 5)
    flat = weight.reshape(-1)
    chosen = torch.tensor([True, False, False, True, False])
    for first, last in ((0, 35), (3, 35), (0, 12), (6, 29), (11, 13), (2, 4)):
        rows = torch.arange(first, last) // 5
        cols = torch.arange(first, last) % 5
        expected = torch.zeros(5).index_add_(0, cols, flat[first:last].square())
        assert torch.allclose(column_sq(flat[first:last], first, 5), expected), (first, last)
        assert torch.equal(column_pattern(chosen, first, last - first), chosen[cols]), (first, last)
        assert rows.numel() == last - first


def test_auto_interval_waits_until_enough_weights_are_due() -> None:
    rule = AutoInterval(ratio=0.5, weights=2)
    chosen = [torch.tensor([True, False, False, False])] * 2
    norms = [torch.tensor([4.0, 1.0, 1.0, 1.0]), torch.tensor([4.0, 0.5, 0.5, 0.5])]
    due = []
    for _ in range(5):
        rule.observe(norms, chosen)
        due.append(rule.due())
    # Weight 0 catches up (rest mass 1 per step against 4 selected) after 4 steps, weight 1 after 8.
    assert due == [False, False, False, True, True]
    rule.reset()
    assert not rule.due()


def _update(policy: ZenFlowPolicy) -> ZenFlowUpdate:
    model = torch.nn.Linear(6, 4, bias=False)
    master = torch.nn.Parameter(model.weight.detach().reshape(-1).clone())
    optimizer = torch.optim.SGD([master], lr=0.1)
    return ZenFlowUpdate(optimizer, policy, [(0, 24, [(0, (4, 6))])], group=None)


def test_columns_are_selected_again_only_with_an_empty_accumulator() -> None:
    policy = ZenFlowPolicy(topk_ratio=0.4, select_strategy="step", select_interval=3, update_interval=2)
    update = _update(policy)
    selected_at, columns = [], []
    for step in range(8):
        grad = torch.arange(1, 25, dtype=torch.float32) * 1e-3
        grad.view(4, 6)[:, step % 6] = 10.0  # a different dominant column every step
        before = update.selections
        update.step([grad], 1.0)
        if update.selections > before:
            selected_at.append(step)
            columns.append(update.groups[0].split.mask().view(4, 6)[0].nonzero().flatten().tolist())
    # Asked for at steps 3 and 6; run at the first step from there with the accumulator empty (4 and 6).
    assert selected_at == [0, 4, 6]
    assert columns == [[0, 4, 5], [3, 4, 5], [0, 4, 5]]
    assert update.host_updates == 4  # after steps 1, 3, 5 and 7


def test_auto_update_interval_applies_the_rest_once_it_has_caught_up() -> None:
    update = _update(ZenFlowPolicy(topk_ratio=0.1, update_interval="auto", auto_ratio=1.0))
    for _ in range(12):
        grad = torch.ones(24) * 0.5
        grad.view(4, 6)[:, 0] = 2.0  # the selected column's norm is 4x the others'
        update.step([grad], 1.0)
    # Each rest column receives a quarter of the selected norm per step: due every 4 steps.
    assert update.host_updates == 3


def test_overlapped_host_update_runs_on_a_second_optimizer_and_lands_one_step_late() -> None:
    master = torch.nn.Parameter(torch.randn(24))
    optimizer = torch.optim.AdamW([master], lr=0.1)  # its defaults hold a key its constructor does not take
    policy = ZenFlowPolicy(
        topk_ratio=0.2, select_strategy="step", select_interval=100, update_interval=2, overlap_step=True
    )
    update = ZenFlowUpdate(optimizer, policy, [(0, 24, [(0, (4, 6))])], group=None)
    seen = []
    for _ in range(4):
        before = master.detach().clone()
        update.step([torch.linspace(-1, 1, 24)], 1.0)
        rest = update.groups[0].split.mask(selected=False)
        seen.append((update.host_updates, bool((master.detach()[rest] != before[rest]).any())))
    # Submitted after steps 1 and 3; the first lands at step 2, the second is still in flight after step 3.
    assert seen == [(0, False), (0, False), (1, True), (1, False)]
    update.shutdown()  # settles the one in flight
    assert update.host_updates == 2


def test_column_split_packs_what_the_mask_selects_in_the_same_order() -> None:
    # A partition holding: a 1-D span, a weight cut mid-row at both ends, a gap, a whole weight, a weight piece
    # inside one row, and a trailing span; every packing must equal the boolean mask's, for both paths.
    torch.manual_seed(0)
    shapes = {"a": (5, 7), "b": (3, 4), "c": (2, 9)}
    keeps = {name: torch.rand(shape[1]) < 0.4 for name, shape in shapes.items()}
    keeps["b"][:] = False  # a weight with no selected column
    keeps["b"][2] = True
    #                 local, first (element of the weight), numel, cols
    layout = [("a", 3, 4, 26), ("b", 31, 0, 12), ("c", 45, 2, 5)]
    numel = 56
    pieces, mask = [], torch.ones(numel, dtype=torch.bool)
    offset = 0
    for name, local, first, n in layout:
        cols = shapes[name][1]
        pieces.append(ColumnPiece(local, first, n, cols, offset))
        offset += cols
        mask[local : local + n] = column_pattern(keeps[name], first, n)
    split = ColumnSplit(numel, pieces, [keeps[name] for name, *_ in layout])
    assert split.counts == (int(mask.sum()), int((~mask).sum()))
    assert torch.equal(split.mask(), mask) and torch.equal(split.mask(selected=False), ~mask)
    values = torch.randn(numel)
    for selected, where in ((True, mask), (False, ~mask)):
        assert torch.equal(split.take(values, selected), values[where])
        packed = torch.randn(int(where.sum()))
        got, expected = values.clone(), values.clone()
        split.put_(got, packed, selected)
        assert torch.equal(got, expected.masked_scatter_(where, packed))
        got = values.clone()
        split.fill_(got, 0.0, selected)
        assert torch.equal(got, values.masked_fill(where, 0.0))
    everything = ColumnSplit(numel, pieces, None)
    assert torch.equal(everything.take(values, True), values) and everything.take(values, False).numel() == 0
    # A partition stored in several pieces (a segmented flat buffer): each window's split packs its share of the
    # whole packing, found at the offset it names, and scatters it back the same way.
    for whole in (split, everything):
        packed = whole.take(values, True)
        for start, end in ((0, 56), (0, 10), (10, 33), (33, 50), (50, 56), (5, 6), (20, 20)):
            offset, window = whole.window(start, end)
            count = window.counts[0]
            assert torch.equal(window.take(values[start:end], True), packed[offset : offset + count]), (start, end)
            got, expected = values.clone(), values.clone()
            window.put_(got[start:end], -packed[offset : offset + count], True)
            expected[start:end] = torch.where(whole.mask()[start:end], -values[start:end], values[start:end])
            assert torch.equal(got, expected), (start, end)


def test_a_checkpoint_taken_while_the_worker_packs_sees_the_accumulator_it_emptied() -> None:
    # The overlapped update packs (and empties) the accumulator on its worker; a state_dict taken before the
    # worker got to it must wait for it, not save the gradients the update in flight already holds.
    import threading

    master = torch.nn.Parameter(torch.randn(24))
    policy = ZenFlowPolicy(
        topk_ratio=0.2, select_strategy="step", select_interval=100, update_interval=2, overlap_step=True
    )
    update = ZenFlowUpdate(torch.optim.AdamW([master], lr=0.1), policy, [(0, 24, [(0, (4, 6))])], group=None)
    update.step([torch.linspace(-1, 1, 24)], 1.0)
    gate = threading.Event()
    update._executor().submit(gate.wait)  # the worker is busy: the next host update queues behind this
    update.step([torch.linspace(-1, 1, 24)], 1.0)  # the host update is now submitted, not yet started
    assert update.pending is not None and update.groups[0].acc is not None and update.groups[0].acc.any()
    threading.Timer(0.2, gate.set).start()
    saved = update.state_dict()
    assert not saved["partitions"]["accumulator"][0].any()
    assert saved["pending_host_step_counts"] is not None
    update.shutdown()


def test_step_returns_before_the_accumulation_and_the_sums_land_after() -> None:
    # [Note: zenflow deferred accumulation]: the masked-out gradients are added on the worker after step()
    # returns; finish_accumulating waits for them, and the sums are the ones the synchronous addition forms.
    import threading

    grads = [torch.linspace(-1, 1, 24) * (i + 1) for i in range(3)]
    accs = []
    for defer in (True, False):
        master = torch.nn.Parameter(torch.randn(24, generator=torch.Generator().manual_seed(0)))
        policy = ZenFlowPolicy(
            topk_ratio=0.2, select_strategy="step", select_interval=100, update_interval=100, overlap_step=False
        )
        update = ZenFlowUpdate(torch.optim.AdamW([master], lr=0.1), policy, [(0, 24, [(0, (4, 6))])], group=None)
        update.step([grads[0]], 0.5)  # selects the columns, then accumulates the rest
        update.finish_accumulating()
        before = update.groups[0].acc.clone()
        gate = threading.Event()
        if defer:
            update._executor().submit(gate.wait)  # the worker is busy: the next addition queues behind this
        try:
            update.step([grads[1]], 0.5)
            if defer:
                assert torch.equal(update.groups[0].acc, before)  # step() returned, nothing added yet
        finally:
            gate.set()
        update.finish_accumulating()
        assert not torch.equal(update.groups[0].acc, before)
        update.step([grads[2]], 0.25)
        update.finish_accumulating()
        accs.append(update.groups[0].acc.clone())
        update.shutdown()
    assert torch.equal(accs[0], accs[1])


def test_columns_stepped_on_the_device_match_the_host_path() -> None:
    # The every-step path stepped beside the working weights ([Note: zenflow columns]) against the same run with
    # it on the host: masters, moments and step counts agree once written back, through selections and both
    # kinds of host update.
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    results = []
    for device in (None, torch.device("cpu")):
        for overlap in (False, True):
            torch.manual_seed(0)
            master = torch.nn.Parameter(torch.randn(48), requires_grad=False)
            optimizer = DeepSpeedCPUAdam([master], lr=0.05, weight_decay=0.1)
            policy = ZenFlowPolicy(
                topk_ratio=0.3, select_strategy="step", select_interval=4, update_interval=2, overlap_step=overlap
            )
            layout = [(0, 48, [(0, (4, 6)), (24, (6,)), (30, (3, 6))])]
            update = ZenFlowUpdate(optimizer, policy, layout, group=None, device=device)
            for step in range(9):
                grad = torch.randn(48, generator=torch.Generator().manual_seed(step))
                update.step([grad.to(torch.bfloat16)], 0.5)
            update.shutdown()  # settles and writes the columns back
            state = optimizer.state[master]
            results.append((master.detach().clone(), state["exp_avg"].clone(), state["step"], update.column_steps))
    for host, on_device in zip(results[:2], results[2:], strict=True):
        assert host[3] == 0 and on_device[3] > 0
        assert host[2] == on_device[2]
        torch.testing.assert_close(on_device[0], host[0], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(on_device[1], host[1], rtol=1e-6, atol=1e-7)


def test_the_selected_gradient_is_sent_in_its_own_dtype_and_scaled_on_arrival() -> None:
    # [Note: zenflow columns]: the packed gradient goes over in its dtype and is converted and scaled where the
    # columns live; the values are the host path's (convert, then multiply in fp32), bit for bit.
    from deepspeed._core.grads.convert import convert_scaled
    from deepspeed._core.optim.zenflow_device import ColumnGradUpload

    torch.manual_seed(0)
    keep = torch.rand(6) < 0.5
    keep[0] = True
    split = ColumnSplit(30, [ColumnPiece(0, 0, 24, 6, 0)], [keep])
    upload = ColumnGradUpload(torch.device("cpu"))
    for dtype, coef in ((torch.bfloat16, 0.37), (torch.bfloat16, 1.0), (torch.float32, 0.5), (torch.float32, 1.0)):
        raw = torch.randn(30).to(dtype)
        sent = upload.send(split, raw, coef)
        expected = torch.empty(split.counts[0])
        convert_scaled(expected, split.take(raw, True), coef)
        assert sent.dtype == torch.float32 and torch.equal(sent, expected), (dtype, coef)
    upload.wait()


@pytest.mark.parametrize("warm_up", [0, 1])
def test_an_in_place_host_update_starts_after_the_publish_and_a_sync_waits_for_it(warm_up: int) -> None:
    # [Note: zenflow in-place host update]: with the selected columns stepped apart (here on the CPU too), the
    # background update steps the host master in place: it starts only when asked (after the publish read the
    # master), a sync of the columns waits for it, and its late elements equal the synchronous update's, with the
    # columns apart (no set-aside of the selected elements, whose host copies are stale) or on the host, and the
    # packed background update's (the every-step path on the host, with overlap_step). Without a warm-up it is the
    # late path's first update: its moments start from zero, created over the whole partition.
    import threading

    from deepspeed.ops.adam import DeepSpeedCPUAdam

    grads = [torch.linspace(-1, 1, 24) * (1 + 0.1 * i) for i in range(warm_up + 2)]
    masters = {}
    cpu = torch.device("cpu")
    for overlap, device in ((False, None), (False, cpu), (True, cpu), (True, None)):
        master = torch.nn.Parameter(torch.randn(24, generator=torch.Generator().manual_seed(0)), requires_grad=False)
        policy = ZenFlowPolicy(
            topk_ratio=0.2,
            select_strategy="step",
            select_interval=100,
            update_interval=2,
            overlap_step=overlap,
            full_warm_up_rounds=warm_up,
        )
        update = ZenFlowUpdate(DeepSpeedCPUAdam([master], lr=0.1), policy, [(0, 24, [(0, (4, 6))])], None, device)
        for grad in grads:  # the warm-up, then two accumulated steps: the host update is due after them
            update.step([grad], 1.0)
        rest = update.groups[0].split.mask(selected=False)
        if overlap and device is None:  # packed: started at once, its values written into the master when settled
            assert update.pending is not None and not update.pending.in_place
            update.settle()
        elif overlap:
            # Due, not started: the publish comes first.
            assert update.pending is not None and update.pending.job is None and update.pending.in_place
            before = master.detach()[rest].clone()
            gate = threading.Event()
            update._executor().submit(gate.wait)  # the worker is busy: the update queues behind this
            update.start_host_update()
            assert update.pending is not None and update.pending.in_place
            synced = threading.Thread(target=update.sync_columns)
            synced.start()
            synced.join(0.3)
            waited = synced.is_alive()  # the sync is held back by the update still to run
            gate.set()
            synced.join()
            assert waited
            assert not torch.equal(master.detach()[rest], before)
        else:
            assert update.pending is None and update.host_updates == 1
            # With the columns apart nothing was set aside: no kept buffer of the selected master exists (on the
            # host, the every-step path packs into one each step anyway).
            assert ((0, "master") in update._buffers) == (device is None)
        masters[overlap, device] = master.detach()[rest].clone()
        for key in ("exp_avg", "exp_avg_sq"):  # the late path's moments, whatever route stepped them
            masters[overlap, device, key] = update.optimizer.state[master][key][rest].clone()
        update.shutdown()
        assert update.host_updates == 1 and update.in_place_updates == int(overlap and device is not None)
    for what in ((), ("exp_avg",), ("exp_avg_sq",)):
        first, *others = [v for k, v in masters.items() if k[2:] == what]
        assert len(others) == 3 and all(torch.equal(first, other) for other in others), what
