// One reply streamed from v1/chat/completions (a relative URL: the page works wherever the server is
// reached): fetch, the body read as server-sent events, each chunk's text and token sources added to the
// reply. Stop is the AbortController's signal; the server aborts the request when the connection goes.
'use strict';
(function (B) {
  class HttpError extends Error {
    constructor(status, message) { super(message); this.status = status; }
  }

  async function errorMessage(response) {
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) return `${response.status}: ${body.error.message}`;
    } catch (err) { /* not JSON */ }
    return `The server answered ${response.status} ${response.statusText}.`;
  }

  // Stream the reply to `body` (the request) into `msg`; onUpdate(msg) after each chunk with text.
  // Resolves when the stream ends; rejects with AbortError (stopped), HttpError or Error.
  async function run(body, headers, msg, signal, onUpdate) {
    msg.stats.sent = performance.now();
    const response = await fetch('v1/chat/completions', { method: 'POST', headers, body: JSON.stringify(body),
      signal, cache: 'no-store' });
    if (!response.ok) throw new HttpError(response.status, await errorMessage(response));
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = '', finished = false;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let cut;
      while ((cut = buffer.search(/\r?\n\r?\n/)) !== -1) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, '');
        const data = event.split(/\r?\n/).filter((l) => l.startsWith('data:')).map((l) => l.slice(5).trim())
          .join('\n');
        if (!data) continue;
        if (data === '[DONE]') { finished = true; continue; }
        if (take(JSON.parse(data), msg)) onUpdate(msg);
      }
    }
    if (!finished) throw new Error('The connection closed before the reply ended.');
  }

  // Fold one chunk into the reply; true if it brought tokens.
  function take(chunk, msg) {
    if (chunk.error) throw new Error(chunk.error.message || 'The server reported an error.');
    const now = performance.now();
    if (chunk.usage) msg.stats.tokens = chunk.usage.completion_tokens;
    const ext = chunk.blockspec;
    if (ext && ext.speculative_algorithm === 'DFLASH' && ext.num_verify_steps > 0) {
      msg.stats.tau = ext.mean_accept_length;
    }
    const choice = chunk.choices && chunk.choices[0];
    if (!choice) return false;
    const text = (choice.delta && choice.delta.content) || '';
    const pieces = choice.token_sources;
    if (!text && !(pieces && pieces.length)) return false;
    if (msg.stats.first === undefined) {
      msg.stats.first = now;
      msg.stats.ttft = (now - msg.stats.sent) / 1000;
    }
    msg.stats.last = now;
    if (pieces && msg.tok) {
      for (const p of pieces) {
        msg.tok.len.push(p.text.length);
        msg.tok.src += B.LETTER[p.source] || 't';
        msg.tok.step.push(p.step);
      }
    } else if (text) {
      msg.tok = null; // a server that sends no token sources: plain text
    }
    msg.content += text;
    return true;
  }

  B.stream = { run, HttpError };
})(window.Blockspec);
