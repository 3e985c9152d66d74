"""Independent references of the serving rules the graded tests share: one continuous-batching step
and a whole run of them, as plain loops over lists (written from the documented rules, not the library)."""


def ref_step(running, waiting, num_blocks, bs, max_seqs, max_tokens, watermark):
    """The documented rules, as a loop over lists."""
    def blocks(n):
        return -(-n // bs)
    free = num_blocks - sum(blocks(n) for _, n in running)
    queue, waiting = list(running), list(waiting)
    decodes, preempted = [], []
    while queue:
        seq = queue.pop(0)
        needs_block, preempted_itself = seq[1] % bs == 0, False
        while needs_block and free == 0:          # make room: the youngest not yet scheduled goes first
            victim = queue.pop() if queue else seq
            free += blocks(victim[1])
            preempted.append(victim[0])
            waiting.insert(0, victim)
            preempted_itself = victim is seq
        if preempted_itself:
            continue
        free -= needs_block
        decodes.append(seq[0])
    prefills, tokens = [], len(decodes)
    while not preempted and waiting:
        seq_id, n = waiting[0]
        if len(decodes) + len(prefills) + 1 > max_seqs or (tokens and tokens + n > max_tokens) \
                or blocks(n) + watermark > free:
            break
        free -= blocks(n)
        tokens += n
        prefills.append(seq_id)
        waiting.pop(0)
    return {"decodes": decodes, "prefills": prefills, "preempted": preempted,
            "waiting": [s for s, _ in waiting], "num_free_blocks": free}



def ref_run(requests, num_blocks, bs, max_seqs, max_tokens, watermark):
    """Steps of `ref_step` until every request has produced its tokens: running entries are (id, slots in
    its table), waiting ones (id, tokens to prefill); produced[id] counts each request's output tokens."""
    produced = {i: 0 for i in range(len(requests))}
    running, waiting, steps = [], [(i, p) for i, (p, _) in enumerate(requests)], []
    while running or waiting:
        step = ref_step(running, waiting, num_blocks, bs, max_seqs, max_tokens, watermark)
        steps.append({k: step[k] for k in ("decodes", "prefills", "preempted")})
        slots = dict(running)
        queued = dict(waiting)
        new_running = []
        for seq in step["decodes"]:
            slots[seq] += 1
        for seq in step["prefills"]:
            slots[seq] = queued[seq]
        for seq in [s for s, _ in running if s in step["decodes"]] + step["prefills"]:
            produced[seq] += 1
            if produced[seq] < requests[seq][1]:
                new_running.append((seq, slots[seq]))
        running = new_running
        waiting = [(s, requests[s][0] + produced[s]) for s in step["waiting"]]
        if len(steps) > 10_000:
            raise AssertionError("the reference run did not finish")
    return steps
