// The chat page: conversations, the API key, sending (Enter sends, Shift+Enter breaks the line) and Stop.
// The other scripts keep things in the browser (settings.js), draw replies (reply.js, with markdown.js),
// stream them (stream.js) and show the engine (live.js).
'use strict';
(function (B) {
  const { $, el } = B;
  const saveChats = () => B.settings.saveChats(state.chats);
  const state = {
    chats: [], current: null, settings: null, key: '', model: null, card: null,
    streaming: null, // {chat, msg, controller}
    dirty: new Set(), // replies to draw again on the next frame
  };

  // ---- conversations -----------------------------------------------------------------------------------
  function newChat() {
    if (state.current && !state.current.messages.length) { $('input').focus(); return; }
    const chat = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 7), title: 'New chat',
      created: Date.now(), messages: [] };
    state.chats.unshift(chat);
    openChat(chat);
    $('input').focus();
  }

  function openChat(chat) {
    state.current = chat;
    renderChatList();
    renderLog();
    closeSidebar();
  }

  function deleteChat(chat) {
    if (state.streaming && state.streaming.chat === chat) state.streaming.controller.abort();
    state.chats = state.chats.filter((c) => c !== chat);
    saveChats();
    if (state.current === chat) {
      state.current = state.chats[0] || null;
      if (!state.current) { newChat(); return; }
    }
    renderChatList();
    renderLog();
  }

  function renderChatList() {
    const nav = $('chats');
    nav.replaceChildren();
    for (const chat of state.chats) {
      if (!chat.messages.length && chat !== state.current) continue;
      const row = el('div', 'chat-item' + (chat === state.current ? ' active' : ''));
      const open = el('button', 'open', chat.title);
      open.type = 'button';
      open.title = chat.title;
      if (chat === state.current) open.setAttribute('aria-current', 'true');
      open.addEventListener('click', () => openChat(chat));
      const del = el('button', 'delete', '×');
      del.type = 'button';
      del.setAttribute('aria-label', 'Delete conversation: ' + chat.title);
      del.title = 'Delete';
      del.addEventListener('click', () => deleteChat(chat));
      row.append(open, del);
      nav.append(row);
    }
  }

  function renderLog() {
    const log = $('log');
    log.querySelectorAll('.msg').forEach((node) => node.remove());
    const messages = state.current ? state.current.messages : [];
    $('empty').hidden = messages.length > 0;
    for (const msg of messages) show(msg);
    log.scrollTop = log.scrollHeight;
  }

  function show(msg) {
    if (msg.role === 'user') {
      const node = el('div', 'msg user');
      node.append(el('div', 'bubble', msg.content));
      $('log').append(node);
      return;
    }
    $('log').append(B.reply.node(msg));
    paint(msg);
  }

  function paint(msg) {
    const messages = state.current ? state.current.messages : [];
    const last = msg === messages[messages.length - 1] && !state.streaming;
    B.reply.paint(msg, last ? regenerate : null);
  }

  // ---- sending --------------------------------------------------------------------------------------------
  function headers() {
    const h = { 'Content-Type': 'application/json' };
    if (state.key) h.Authorization = 'Bearer ' + state.key;
    return h;
  }

  function requestBody(messages) {
    const s = state.settings;
    const all = [];
    if (s.system.trim()) all.push({ role: 'system', content: s.system });
    for (const m of messages) all.push({ role: m.role, content: m.content });
    const body = { messages: all, stream: true, stream_options: { include_usage: true },
      return_token_sources: true, temperature: Number(s.temperature), top_p: Number(s.top_p),
      max_tokens: Number(s.max_tokens) };
    if (state.model) body.model = state.model;
    if (Number(s.top_k) > 0) body.top_k = Number(s.top_k);
    if (s.seed !== '' && s.seed !== null && Number.isInteger(Number(s.seed))) body.seed = Number(s.seed);
    return body;
  }

  function send() {
    const input = $('input');
    const text = input.value;
    if (!text.trim() || state.streaming) return;
    if (!state.current) newChat();
    const chat = state.current;
    if (!chat.messages.length) chat.title = text.trim().replace(/\s+/g, ' ').slice(0, 48);
    const msg = { role: 'user', content: text };
    chat.messages.push(msg);
    $('empty').hidden = true;
    show(msg);
    input.value = '';
    autosize();
    renderChatList();
    generate(chat);
  }

  function regenerate() {
    const chat = state.current;
    if (!chat || state.streaming) return;
    const last = chat.messages[chat.messages.length - 1];
    if (last && last.role === 'assistant') {
      chat.messages.pop();
      renderLog();
    }
    if (chat.messages.length) generate(chat);
  }

  async function generate(chat) {
    const body = requestBody(chat.messages);
    const msg = { role: 'assistant', content: '', tok: { len: [], src: '', step: [] }, stats: {},
      state: 'streaming' };
    chat.messages.push(msg);
    const controller = new AbortController();
    state.streaming = { chat, msg, controller };
    if (chat === state.current) { show(msg); scrollToEnd(true); }
    setBusy(true);
    try {
      await B.stream.run(body, headers(), msg, controller.signal, schedulePaint);
      msg.state = 'done';
    } catch (err) {
      if (err.name === 'AbortError') msg.state = 'stopped';
      else { msg.state = 'error'; msg.error = String(err.message || err); }
      if (err.status === 401) askForKey(err.message);
    } finally {
      state.streaming = null;
      setBusy(false);
      if (!msg.content && msg.state === 'stopped') msg.tok = null;
      paint(msg);
      saveChats();
    }
  }

  function schedulePaint(msg) {
    if (!state.dirty.size) {
      requestAnimationFrame(() => {
        const stick = nearBottom();
        for (const m of state.dirty) paint(m);
        state.dirty.clear();
        if (stick) scrollToEnd(true);
      });
    }
    state.dirty.add(msg);
  }

  function nearBottom() {
    const log = $('log');
    return log.scrollHeight - log.scrollTop - log.clientHeight < 80;
  }

  function scrollToEnd(force) {
    const log = $('log');
    if (force || nearBottom()) log.scrollTop = log.scrollHeight;
  }

  function setBusy(busy) {
    $('send').hidden = busy;
    $('stop').hidden = !busy;
    $(busy ? 'stop' : 'input').focus({ preventScroll: true });
  }

  // ---- settings and the API key ------------------------------------------------------------------------
  function setKey(key) {
    state.key = key.trim();
    B.settings.saveKey(state.key);
  }

  function askForKey(detail) {
    $('key-error').hidden = !state.key;
    $('key-error').textContent = state.key ? 'The server did not accept that key (' + detail + ').' : '';
    $('key-input').value = '';
    if (!$('keydialog').open) $('keydialog').showModal();
  }

  async function connect() {
    try {
      const response = await fetch('v1/models', { headers: headers(), cache: 'no-store' });
      if (response.status === 401) { $('model').textContent = 'API key needed'; askForKey('401'); return; }
      if (!response.ok) throw new Error(String(response.status));
      const card = (await response.json()).data[0];
      state.model = card.id;
      state.card = card;
      const spec = card.speculative_algorithm === 'DFLASH' ? `DFlash · block ${card.block_size}`
        : 'plain decoding';
      $('model').replaceChildren(document.createTextNode(card.id), el('span', 'chip', spec));
    } catch (err) {
      $('model').textContent = 'server not reachable';
    }
  }

  // ---- wiring ------------------------------------------------------------------------------------------
  function autosize() {
    const input = $('input');
    input.style.height = 'auto';
    input.style.height = Math.min(input.scrollHeight + 2, window.innerHeight * 0.4) + 'px';
  }

  function applySources() {
    document.body.classList.toggle('hide-sources', !state.settings.sources);
    $('show-sources').checked = state.settings.sources;
  }

  function closeSidebar() {
    $('sidebar').classList.remove('open');
    $('menu').setAttribute('aria-expanded', 'false');
  }

  function on(id, event, handler) { $(id).addEventListener(event, handler); }

  function init() {
    state.settings = B.settings.load();
    state.key = B.settings.key();
    state.chats = B.settings.loadChats();
    applySources();
    if (state.chats.length) openChat(state.chats[0]); else newChat();

    on('composer', 'submit', (e) => { e.preventDefault(); send(); });
    on('input', 'keydown', (e) => {
      if (e.key !== 'Enter' || e.shiftKey || e.isComposing || e.keyCode === 229) return; // 229: an IME
      e.preventDefault();
      send();
    });
    on('input', 'input', autosize);
    on('stop', 'click', () => state.streaming && state.streaming.controller.abort());
    on('examples', 'click', (e) => {
      const button = e.target.closest('button');
      if (button) { $('input').value = button.textContent; send(); }
    });
    on('new-chat', 'click', newChat);
    on('menu', 'click', () => $('menu').setAttribute('aria-expanded',
      String($('sidebar').classList.toggle('open'))));
    document.querySelector('.main').addEventListener('click', (e) => {
      if (!e.target.closest('#menu')) closeSidebar();
    });
    on('show-sources', 'change', (e) => {
      state.settings.sources = e.target.checked;
      B.settings.save(state.settings);
      applySources();
    });
    on('open-settings', 'click', () => {
      B.settings.fill(state.settings, state.key);
      $('settings').showModal();
    });
    on('settings-reset', 'click', () => B.settings.fill({ ...B.settings.DEFAULTS }, state.key));
    on('settings', 'close', () => {
      if ($('settings').returnValue !== 'save') return;
      state.settings = B.settings.read(state.settings, state.card && state.card.max_model_len);
      B.settings.save(state.settings);
      if ($('set-api-key').value.trim() !== state.key) { setKey($('set-api-key').value); connect(); }
    });
    on('keydialog', 'close', () => {
      if ($('keydialog').returnValue !== 'ok') return;
      setKey($('key-input').value);
      connect();
      const last = state.current && state.current.messages[state.current.messages.length - 1];
      if (last && last.role === 'assistant' && last.error && last.error.startsWith('401')) regenerate();
    });
    B.reply.attach($('log'));
    connect();
    B.live.start();
    $('input').focus();
  }

  init();
})(window.Blockspec);
