// The engine panel: GET stats once a second while the page is visible; rates are differences between the
// newest read and one about five seconds older (the counters only grow; `time` is the server's clock).
'use strict';
(function (B) {
  const { $, fmt, pct } = B;
  const PLAN_NAMES = { dflash: 'DFlash', lookup: 'prompt lookup', mixed: 'lookup + DFlash',
    merged: 'copy + DFlash tree', plain: 'plain step' };
  const reads = [];

  const sum = (obj) => Object.values(obj).reduce((a, b) => a + b, 0);

  async function poll() {
    if (document.visibilityState !== 'visible') return;
    let snap;
    try {
      const response = await fetch('stats', { cache: 'no-store' });
      if (!response.ok) throw new Error(String(response.status));
      snap = await response.json();
    } catch (err) {
      $('engine-dot').className = 'dot down';
      $('engine-dot').title = 'the server is not answering';
      return;
    }
    reads.push(snap);
    while (reads.length > 6) reads.shift();
    show(snap, reads[0]);
  }

  function describe(plan, busy) {
    if (!plan) return '–';
    let text = PLAN_NAMES[plan.kind] || plan.kind;
    if (plan.block_size && plan.kind !== 'lookup') {
      text += plan.tree_budget ? ` tree ${plan.tree_budget}` : ` block ${plan.block_size}`;
    }
    if (['lookup', 'mixed', 'merged'].includes(plan.kind)) text += ` · width ${plan.width}`;
    return busy ? text : text + ' (idle)';
  }

  function show(now, then) {
    const busy = now.running_requests > 0;
    $('engine-dot').className = 'dot ' + (busy ? 'busy' : 'up');
    $('engine-dot').title = busy ? 'generating' : 'idle';
    $('live-requests').textContent = `${now.running_requests} running · ${now.waiting_requests} waiting`;
    const dt = now.time - then.time;
    const made = sum(now.tokens_total) - sum(then.tokens_total);
    $('live-tps').textContent = dt > 0 ? fmt(made / dt, 1) : '–';
    const rows = now.verify_rows_total - then.verify_rows_total;
    const verified = now.verify_tokens_total - then.verify_tokens_total;
    $('live-tau').textContent = now.speculative_algorithm !== 'DFLASH' ? 'no draft'
      : rows > 0 ? fmt(verified / rows, 2) : '–';
    $('live-plan').textContent = describe(now.plan, busy);
    const steps = {};
    for (const k of Object.keys(now.steps_total)) steps[k] = now.steps_total[k] - (then.steps_total[k] || 0);
    const total = sum(steps);
    $('live-steps').textContent = total ? Object.entries(steps).filter(([, v]) => v)
      .map(([k, v]) => `${k} ${pct(v / total)}`).join(' · ') : '–';
    const budget = now.kv_tokens_budget || 0;
    $('live-kv').textContent = `${now.kv_tokens_used} / ${budget}`;
    const used = budget ? Math.min(1, now.kv_tokens_used / budget) : 0;
    $('live-kv-bar').style.width = (100 * used).toFixed(1) + '%';
  }

  function start() {
    document.addEventListener('visibilitychange', poll);
    poll();
    setInterval(poll, 1000);
  }

  B.live = { start };
})(window.Blockspec);
