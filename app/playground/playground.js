// The playground: calls this server's own /info, /embed and /encode, and draws what they
// return. Plain script, no framework and no build step, so the app can serve it as it is.
'use strict';

(() => {
  // What the page shows, as data: tests (and curious people, from the console) read the values
  // from here rather than from pixels.
  const state = {
    info: null,
    sentences: [],
    similarity: null, // N x N cosine matrix
    selected: 0, // index of the sentence whose tokens and attention are shown
    tokens: null, // [{id, text, special, start, stop, piece}], /tokenize's shape plus the vocabulary's spelling
    attention: null, // {sentence, layer, head ('mean' or a number), values: T x T}
    chunks: null, // [{start, end, tokens, text, score}] of the long text, score against the query
    error: null,
    busy: 0, // requests in flight
  };
  window.playground = state;

  // Viridis at ten even steps: perceptually uniform, readable with the common colour-vision
  // deficiencies and in greyscale.
  const VIRIDIS = [
    '#440154', '#482878', '#3e4a89', '#31688e', '#26828e',
    '#1f9e89', '#35b779', '#6dcd59', '#b4de2c', '#fde725',
  ].map((hex) => {
    const n = parseInt(hex.slice(1), 16);
    return [n >> 16, (n >> 8) & 255, n & 255];
  });

  function viridis(t) {
    const x = Math.min(1, Math.max(0, Number.isFinite(t) ? t : 0)) * (VIRIDIS.length - 1);
    const i = Math.min(Math.floor(x), VIRIDIS.length - 2);
    const f = x - i;
    return VIRIDIS[i].map((c, k) => Math.round(c + (VIRIDIS[i + 1][k] - c) * f));
  }

  const rgb = (c) => `rgb(${c[0]}, ${c[1]}, ${c[2]})`;

  // White text where it contrasts better than near-black (WCAG relative luminance).
  function isDark(c) {
    const [r, g, b] = c.map((v) => {
      const s = v / 255;
      return s <= 0.03928 ? s / 12.92 : ((s + 0.055) / 1.055) ** 2.4;
    });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b < 0.18;
  }

  const gradient = () =>
    `linear-gradient(to right, ${VIRIDIS.map((c) => rgb(c)).join(', ')})`;

  const $ = (id) => document.getElementById(id);

  // ---------------------------------------------------------------------------- requests
  class ApiError extends Error {}

  async function api(path, body) {
    const headers = { Accept: 'application/json' };
    const key = $('api-key').value.trim();
    if (key) headers.Authorization = `Bearer ${key}`;
    const init = { method: 'GET', headers };
    if (body !== undefined) {
      init.method = 'POST';
      headers['Content-Type'] = 'application/json';
      init.body = JSON.stringify(body);
    }
    state.busy += 1;
    try {
      let response;
      try {
        // Relative paths: the API sits beside this page, under whatever prefix a proxy adds.
        response = await fetch(path, init);
      } catch (error) {
        throw new ApiError(`/${path}: could not reach the server (${error.message}).`);
      }
      let payload = null;
      try {
        payload = await response.json();
      } catch {
        // Not JSON (a proxy's error page, say): the status line alone has to do.
      }
      if (!response.ok) throw new ApiError(describeFailure(path, response, payload));
      return payload;
    } finally {
      state.busy -= 1;
    }
  }

  // The service answers {"error": str, "error_type": str}; say it in one readable line.
  function describeFailure(path, response, payload) {
    const type = payload && payload.error_type ? payload.error_type : response.statusText;
    const message = payload && typeof payload.error === 'string'
      ? payload.error
      : 'the server gave no explanation';
    let text = `/${path} answered ${response.status} ${type}: ${message}`;
    if (response.status === 401) text += '\nEnter the server\'s API key above and try again.';
    return text;
  }

  function showError(error) {
    state.error = error instanceof Error ? error.message : String(error);
    const box = $('error');
    box.textContent = state.error;
    box.hidden = false;
    if (!(error instanceof ApiError) && error instanceof Error) console.error(error);
  }

  function clearError() {
    state.error = null;
    $('error').hidden = true;
    $('error').textContent = '';
  }

  const setStatus = (text) => { $('status').textContent = text; };

  // ---------------------------------------------------------------------------- /info
  async function loadInfo() {
    const info = await api('info');
    state.info = info;
    const rows = [
      ['Model', info.model_id],
      ['Task', info.task],
      ['Architecture', info.architecture],
      ['Dimensions', info.dimensions],
      ['Max input tokens', info.max_input_tokens],
      ['Pooling', info.pooling],
      ['Normalised', info.normalize ? 'yes' : 'no'],
      ['Device', info.device],
      ['Dtype', info.dtype],
      ['Layers × heads', `${info.num_layers} × ${info.num_heads}`],
      ['Long inputs', info.auto_truncate ? 'truncated' : 'rejected'],
      ['Inputs per request', info.limits.max_inputs_per_request],
      ['Attention values', info.limits.max_attention_values.toLocaleString('en')],
      ['Batch tokens', info.limits.max_batch_tokens.toLocaleString('en')],
      ['Request timeout', `${info.limits.request_timeout} s`],
      ['Version', info.version],
    ];
    const list = $('info');
    list.replaceChildren();
    for (const [name, value] of rows) {
      const dt = document.createElement('dt');
      dt.textContent = name;
      const dd = document.createElement('dd');
      dd.textContent = String(value);
      list.append(dt, dd);
    }
    fillLayerAndHeadSelects(info);
    return info;
  }

  function fillLayerAndHeadSelects(info) {
    const layers = $('layer-select');
    layers.replaceChildren();
    for (let layer = 0; layer < info.num_layers; layer += 1) {
      layers.add(new Option(String(layer), String(layer)));
    }
    layers.value = String(info.num_layers - 1);
    const heads = $('head-select');
    heads.replaceChildren(new Option('mean over heads', 'mean'));
    for (let head = 0; head < info.num_heads; head += 1) {
      heads.add(new Option(String(head), String(head)));
    }
  }

  function showInfoProblem(error) {
    const dt = document.createElement('dt');
    dt.textContent = 'Not loaded';
    const dd = document.createElement('dd');
    dd.textContent = error.message;
    $('info').replaceChildren(dt, dd);
  }

  // ---------------------------------------------------------------------------- similarity
  function cosineMatrix(vectors) {
    const norms = vectors.map((v) => Math.sqrt(v.reduce((sum, x) => sum + x * x, 0)));
    return vectors.map((a, i) => vectors.map((b, j) => {
      let dot = 0;
      for (let k = 0; k < a.length; k += 1) dot += a[k] * b[k];
      return dot / (norms[i] * norms[j]);
    }));
  }

  function renderSimilarity() {
    const table = $('similarity');
    table.replaceChildren();
    const caption = table.createCaption();
    caption.className = 'hint';
    caption.textContent = 'Rows and columns are the sentences, by number.';
    const header = table.createTHead().insertRow();
    header.append(document.createElement('td'));
    state.sentences.forEach((sentence, j) => {
      const th = document.createElement('th');
      th.scope = 'col';
      th.textContent = String(j + 1);
      th.title = sentence;
      header.append(th);
    });
    const body = table.createTBody();
    state.similarity.forEach((row, i) => {
      const tr = body.insertRow();
      const th = document.createElement('th');
      th.scope = 'row';
      const button = document.createElement('button');
      button.type = 'button';
      button.className = 'sentence-label';
      button.textContent = `${i + 1}. ${state.sentences[i]}`;
      button.title = `Show the tokens and attention of: ${state.sentences[i]}`;
      button.addEventListener('click', () => selectSentence(i));
      th.append(button);
      tr.append(th);
      row.forEach((value, j) => {
        const td = tr.insertCell();
        const colour = viridis(value);
        td.className = isDark(colour) ? 'cell on-dark' : 'cell';
        td.style.backgroundColor = rgb(colour);
        td.textContent = value.toFixed(3);
        td.dataset.row = String(i);
        td.dataset.col = String(j);
        td.dataset.value = String(value);
        td.tabIndex = i === 0 && j === 0 ? 0 : -1;
        td.setAttribute('aria-label', `sentences ${i + 1} and ${j + 1}: cosine ${value.toFixed(3)}`);
      });
    });
    $('similarity-legend').style.background = gradient();
    $('similarity-readout').textContent = '';
    $('similarity-panel').hidden = false;
  }

  function readSimilarityCell(cell) {
    const i = Number(cell.dataset.row);
    const j = Number(cell.dataset.col);
    const value = state.similarity[i][j];
    const readout = $('similarity-readout');
    readout.textContent =
      `“${state.sentences[i]}” ↔ “${state.sentences[j]}”: cosine ${value.toFixed(3)}`;
    readout.dataset.row = String(i);
    readout.dataset.col = String(j);
  }

  function setupSimilarityEvents() {
    const table = $('similarity');
    table.addEventListener('mouseover', (event) => {
      const cell = event.target.closest('td.cell');
      if (cell) readSimilarityCell(cell);
    });
    table.addEventListener('focusin', (event) => {
      if (event.target.matches('td.cell')) readSimilarityCell(event.target);
    });
    table.addEventListener('keydown', (event) => {
      const cell = event.target.closest('td.cell');
      if (!cell) return;
      const n = state.sentences.length;
      let i = Number(cell.dataset.row);
      let j = Number(cell.dataset.col);
      const moves = { ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1] };
      if (event.key === 'Enter' || event.key === ' ') {
        event.preventDefault();
        selectSentence(i);
        return;
      }
      if (!(event.key in moves)) return;
      event.preventDefault();
      i = Math.min(n - 1, Math.max(0, i + moves[event.key][0]));
      j = Math.min(n - 1, Math.max(0, j + moves[event.key][1]));
      const next = table.querySelector(`td.cell[data-row="${i}"][data-col="${j}"]`);
      cell.tabIndex = -1;
      next.tabIndex = 0;
      next.focus();
    });
  }

  // ---------------------------------------------------------------------------- tokens
  function fillSentenceSelect() {
    const select = $('sentence-select');
    select.replaceChildren();
    state.sentences.forEach((sentence, i) => {
      const label = sentence.length > 60 ? `${sentence.slice(0, 57)}…` : sentence;
      select.add(new Option(`${i + 1}. ${label}`, String(i)));
    });
    select.value = String(state.selected);
  }

  function markLabels() {
    document.querySelectorAll('.sentence-label').forEach((button, i) => {
      button.setAttribute('aria-current', String(i === state.selected));
    });
  }

  // Offsets count Unicode code points (as Python does), not UTF-16 units as String.slice does.
  const codePoints = (text) => Array.from(text);

  function tokensOf(sentence, encoded) {
    const chars = codePoints(sentence);
    return encoded.map((token) => ({
      id: token.id,
      text: token.special ? token.text : chars.slice(token.start, token.end).join(''),
      special: token.special,
      start: token.special ? null : token.start,
      stop: token.special ? null : token.end,
      piece: token.text,
    }));
  }

  function showSentence(highlight) {
    const sentence = state.sentences[state.selected];
    const paragraph = $('sentence-text');
    if (!highlight || highlight.start === null) {
      paragraph.textContent = sentence;
      return;
    }
    const chars = codePoints(sentence);
    const mark = document.createElement('mark');
    mark.textContent = chars.slice(highlight.start, highlight.stop).join('');
    paragraph.replaceChildren(
      chars.slice(0, highlight.start).join(''),
      mark,
      chars.slice(highlight.stop).join(''),
    );
  }

  function renderTokens() {
    const list = $('tokens');
    list.replaceChildren();
    (state.tokens || []).forEach((token, index) => {
      const item = document.createElement('li');
      item.className = token.special ? 'token special' : 'token';
      item.textContent = token.piece;
      item.tabIndex = index === 0 ? 0 : -1;
      item.dataset.index = String(index);
      item.title = token.special
        ? `special token, id ${token.id}`
        : `id ${token.id}, characters ${token.start}–${token.stop}: “${token.text}”`;
      item.setAttribute('aria-label', `${token.special ? 'special token' : 'token'} ${token.piece}`);
      list.append(item);
    });
    showSentence(null);
  }

  function activateToken(item) {
    document.querySelectorAll('#tokens .token.active').forEach((el) => el.classList.remove('active'));
    if (!item) {
      showSentence(null);
      return;
    }
    item.classList.add('active');
    showSentence(state.tokens[Number(item.dataset.index)]);
  }

  function setupTokenEvents() {
    const list = $('tokens');
    list.addEventListener('mouseover', (event) => activateToken(event.target.closest('.token')));
    list.addEventListener('mouseleave', () => activateToken(null));
    list.addEventListener('focusin', (event) => activateToken(event.target.closest('.token')));
    list.addEventListener('focusout', () => activateToken(null));
    list.addEventListener('keydown', (event) => {
      const item = event.target.closest('.token');
      if (!item) return;
      const last = state.tokens.length - 1;
      const steps = { ArrowLeft: -1, ArrowUp: -1, ArrowRight: 1, ArrowDown: 1 };
      let index = Number(item.dataset.index);
      if (event.key in steps) index = Math.min(last, Math.max(0, index + steps[event.key]));
      else if (event.key === 'Home') index = 0;
      else if (event.key === 'End') index = last;
      else return;
      event.preventDefault();
      const next = list.children[index];
      item.tabIndex = -1;
      next.tabIndex = 0;
      next.focus();
    });
  }

  // ---------------------------------------------------------------------------- attention
  const heatmap = { image: null, cell: 0, margin: 0, size: 0, cursor: null };
  const LABEL_FONT = '12px ui-monospace, "DejaVu Sans Mono", monospace';

  function drawAttention() {
    const values = state.attention.values;
    const labels = state.tokens.map((token) => token.piece);
    const count = values.length;
    const canvas = $('attention');
    // Cells shrink with the token count so that a 256-token map still fits a laptop screen;
    // labels are drawn only where a cell is tall enough to hold one.
    const cell = Math.max(2, Math.min(30, Math.floor(540 / count)));
    const withLabels = cell >= 12;
    const context = canvas.getContext('2d');
    context.font = LABEL_FONT;
    const margin = withLabels
      ? Math.ceil(Math.max(...labels.map((label) => context.measureText(label).width))) + 10
      : 4;
    const size = margin + count * cell + 4;
    const ratio = window.devicePixelRatio || 1;

    const image = document.createElement('canvas');
    image.width = size * ratio;
    image.height = size * ratio;
    const paint = image.getContext('2d');
    paint.scale(ratio, ratio);
    const largest = Math.max(...values.map((row) => Math.max(...row)));
    values.forEach((row, i) => row.forEach((value, j) => {
      paint.fillStyle = rgb(viridis(largest > 0 ? value / largest : 0));
      paint.fillRect(margin + j * cell, margin + i * cell, cell, cell);
    }));
    if (withLabels) {
      paint.font = LABEL_FONT;
      paint.textBaseline = 'middle';
      labels.forEach((label, i) => {
        paint.fillStyle = state.tokens[i].special ? '#5a606b' : '#1b1d21';
        paint.textAlign = 'right';
        paint.fillText(label, margin - 6, margin + i * cell + cell / 2);
        paint.save();
        paint.translate(margin + i * cell + cell / 2, margin - 6);
        paint.rotate(-Math.PI / 2);
        paint.textAlign = 'left';
        paint.fillText(label, 0, 0);
        paint.restore();
      });
    }

    Object.assign(heatmap, { image, cell, margin, size, cursor: null });
    canvas.width = size * ratio;
    canvas.height = size * ratio;
    canvas.style.width = `${size}px`;
    canvas.style.height = `${size}px`;
    canvas.dataset.rows = String(count);
    canvas.dataset.cols = String(values[0].length);
    $('attention-legend').style.background = gradient();
    $('attention-max').textContent = `${largest.toFixed(3)} (the largest weight in this map)`;
    $('attention-readout').textContent = '';
    paintCursor();
  }

  function paintCursor() {
    const canvas = $('attention');
    const context = canvas.getContext('2d');
    context.setTransform(1, 0, 0, 1, 0, 0);
    context.clearRect(0, 0, canvas.width, canvas.height);
    context.drawImage(heatmap.image, 0, 0);
    document.querySelectorAll('#tokens .query, #tokens .key').forEach((el) => {
      el.classList.remove('query', 'key');
    });
    if (!heatmap.cursor) return;
    const [i, j] = heatmap.cursor;
    const ratio = window.devicePixelRatio || 1;
    const { cell, margin } = heatmap;
    context.scale(ratio, ratio);
    // Black inside white: visible on every colour of the scale.
    context.lineWidth = 2;
    context.strokeStyle = '#fff';
    context.strokeRect(margin + j * cell - 1, margin + i * cell - 1, cell + 2, cell + 2);
    context.strokeStyle = '#000';
    context.strokeRect(margin + j * cell + 1, margin + i * cell + 1, cell - 2, cell - 2);
    const tokens = $('tokens').children;
    tokens[i].classList.add('query');
    tokens[j].classList.add('key');
    const weight = state.attention.values[i][j];
    const readout = $('attention-readout');
    readout.textContent =
      `query ${i} “${state.tokens[i].piece}” → key ${j} “${state.tokens[j].piece}”: ${weight.toFixed(4)}`;
    readout.dataset.row = String(i);
    readout.dataset.col = String(j);
  }

  function setupAttentionEvents() {
    const canvas = $('attention');
    canvas.addEventListener('mousemove', (event) => {
      if (!state.attention) return;
      const box = canvas.getBoundingClientRect();
      const count = state.attention.values.length;
      const j = Math.floor((event.clientX - box.left - heatmap.margin) / heatmap.cell);
      const i = Math.floor((event.clientY - box.top - heatmap.margin) / heatmap.cell);
      if (i < 0 || j < 0 || i >= count || j >= count) return;
      if (heatmap.cursor && heatmap.cursor[0] === i && heatmap.cursor[1] === j) return;
      heatmap.cursor = [i, j];
      paintCursor();
    });
    canvas.addEventListener('focus', () => {
      if (state.attention && !heatmap.cursor) {
        heatmap.cursor = [0, 0];
        paintCursor();
      }
    });
    canvas.addEventListener('keydown', (event) => {
      const moves = { ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1] };
      if (!state.attention || !(event.key in moves)) return;
      event.preventDefault();
      const last = state.attention.values.length - 1;
      const [i, j] = heatmap.cursor || [0, 0];
      heatmap.cursor = [
        Math.min(last, Math.max(0, i + moves[event.key][0])),
        Math.min(last, Math.max(0, j + moves[event.key][1])),
      ];
      paintCursor();
    });
  }

  // ---------------------------------------------------------------------------- flow
  let latest = 0; // the newest selection; answers to older ones are dropped

  async function loadSentence() {
    const ticket = ++latest;
    const index = state.selected;
    const sentence = state.sentences[index];
    const layer = Number($('layer-select').value);
    const headChoice = $('head-select').value;
    const head = headChoice === 'mean' ? 'mean' : Number(headChoice);
    const attention = head === 'mean'
      ? { layers: [layer], reduce: 'mean' }
      : { layers: [layer], heads: [head] };
    const which = `sentence ${index + 1}, layer ${layer}, ${head === 'mean' ? 'mean over heads' : `head ${head}`}`;
    clearError();
    setStatus(`Loading the tokens and attention of ${which}…`);
    $('sentence-panel').hidden = false;
    markLabels();
    try {
      const result = await api('encode', { inputs: [sentence], pooled: false, attention });
      if (ticket !== latest) return;
      const item = result.data[0];
      const map = item.attention[0].values;
      state.tokens = tokensOf(sentence, item.tokens);
      state.attention = { sentence: index, layer, head, values: head === 'mean' ? map : map[0] };
      renderTokens();
      drawAttention();
      $('attention-block').hidden = false;
      const cut = item.truncated ? ' (truncated to the model\'s limit)' : '';
      setStatus(`Showing ${which}: ${state.tokens.length} tokens${cut}.`);
    } catch (error) {
      if (ticket !== latest) return;
      state.attention = null;
      $('attention-block').hidden = true;
      // A map over the server's attention cap still leaves the tokens worth showing.
      state.tokens = await tokensAlone(sentence);
      if (ticket !== latest) return;
      renderTokens();
      setStatus(state.tokens ? `Showing the tokens of sentence ${index + 1}, without attention.` : '');
      showError(error instanceof ApiError ? new ApiError(`Attention of ${which}:\n${error.message}`) : error);
    }
  }

  // The tokens without attention maps; null when even that fails (the first error is shown).
  async function tokensAlone(sentence) {
    try {
      const result = await api('encode', { inputs: [sentence], pooled: false });
      return tokensOf(sentence, result.data[0].tokens);
    } catch {
      return null;
    }
  }

  function selectSentence(index) {
    state.selected = index;
    $('sentence-select').value = String(index);
    loadSentence();
  }

  async function compare() {
    clearError();
    const sentences = $('sentences').value.split(/\r?\n/).map((line) => line.trim()).filter(Boolean);
    if (sentences.length === 0) {
      showError('Type at least one sentence, one per line.');
      return;
    }
    const button = $('run');
    button.disabled = true;
    try {
      if (!state.info) await loadInfo();
      setStatus(`Embedding ${sentences.length} sentence${sentences.length === 1 ? '' : 's'}…`);
      const vectors = await api('embed', { inputs: sentences });
      state.sentences = sentences;
      state.similarity = cosineMatrix(vectors);
      state.selected = 0;
      renderSimilarity();
      fillSentenceSelect();
      await loadSentence();
    } catch (error) {
      setStatus('');
      showError(error);
    } finally {
      button.disabled = false;
    }
  }

  // ---------------------------------------------------------------------------- chunks
  const dot = (a, b) => a.reduce((sum, value, i) => sum + value * b[i], 0);

  async function chunkAndRank() {
    clearError();
    const text = $('document').value;
    const query = $('query').value.trim();
    if (!text.trim() || !query) {
      showError('Type a long text and a query.');
      return;
    }
    const button = $('chunk-run');
    button.disabled = true;
    try {
      if (!state.info) await loadInfo();
      setStatus('Embedding the text in chunks…');
      const chunking = { mode: $('chunk-mode').value, size: Number($('chunk-size').value) };
      const [chunks] = await api('embed_chunks', { inputs: text, chunking });
      const [queryVector] = await api('embed', { inputs: query });
      // Both are unit vectors (normalize defaults to true): their dot product is the cosine.
      state.chunks = chunks.map((chunk) => ({
        start: chunk.start,
        end: chunk.end,
        tokens: chunk.tokens,
        text: text.slice(chunk.start, chunk.end),
        score: dot(chunk.embedding, queryVector),
      }));
      renderChunks();
      setStatus(`${chunks.length} chunk${chunks.length === 1 ? '' : 's'}.`);
    } catch (error) {
      setStatus('');
      showError(error);
    } finally {
      button.disabled = false;
    }
  }

  function renderChunks() {
    const list = $('chunks');
    list.replaceChildren();
    const best = Math.max(...state.chunks.map((chunk) => chunk.score));
    for (const chunk of state.chunks) {
      const item = document.createElement('li');
      item.className = chunk.score === best ? 'chunk best' : 'chunk';
      const bar = document.createElement('span');
      bar.className = 'bar';
      const level = Math.max(0, Math.min(1, chunk.score));
      bar.style.width = `${Math.round(level * 100)}%`;
      bar.style.background = rgb(viridis(level));
      const figure = document.createElement('span');
      figure.className = 'score';
      figure.textContent = `${chunk.score.toFixed(3)} · ${chunk.tokens} tokens · characters ${chunk.start}–${chunk.end}`;
      const words = document.createElement('p');
      words.textContent = chunk.text;
      item.append(figure, bar, words);
      list.append(item);
    }
    $('chunks-panel').hidden = false;
  }

  function setup() {
    $('chunk-form').addEventListener('submit', (event) => {
      event.preventDefault();
      chunkAndRank();
    });
    $('form').addEventListener('submit', (event) => {
      event.preventDefault();
      compare();
    });
    $('sentences').addEventListener('keydown', (event) => {
      if (event.key === 'Enter' && (event.ctrlKey || event.metaKey)) {
        event.preventDefault();
        compare();
      }
    });
    $('sentence-select').addEventListener('change', (event) => selectSentence(Number(event.target.value)));
    $('layer-select').addEventListener('change', () => loadSentence());
    $('head-select').addEventListener('change', () => loadSentence());
    setupSimilarityEvents();
    setupTokenEvents();
    setupAttentionEvents();
    // Without the key a protected server answers 401 here; Compare asks again with the key.
    loadInfo().catch(showInfoProblem);
  }

  setup();
})();
