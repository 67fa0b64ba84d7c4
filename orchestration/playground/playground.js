// The playground page: a form -> POST v1/images/generations -> one card per image, each reproducible alone; or
// (where the app serves videos) POST v1/videos -> one card playing the finished MP4.
// Streamed (server-sent events read through fetch, since EventSource cannot POST) when partial images are asked
// for and the route streams; the whole JSON response otherwise, and whenever streaming fails.
"use strict";

const form = document.getElementById("generate");
const statusLine = document.getElementById("status");
const results = document.getElementById("results");
const STAGE_HEADERS = { llm: "X-Omni-Batch-Invariant-LLM", diffusion: "X-Omni-Batch-Invariant-Diffusion" };

function say(text, kind = "") {
  statusLine.textContent = text;
  statusLine.className = kind;
}

function randomSeed() {
  return Math.floor(Math.random() * 2 ** 31);
}

// The request body as the API takes it: empty optional fields are left out (the server's defaults apply).
function requestBody() {
  const f = form.elements;
  const body = {
    prompt: f.prompt.value, n: Number(f.n.value), size: f.size.value,
    enhance_prompt: f.enhance_prompt.checked, response_format: "b64_json",
  };
  if (f.seed.value !== "") body.seed = Number(f.seed.value);
  if (f.num_inference_steps.value !== "") body.num_inference_steps = Number(f.num_inference_steps.value);
  if (f.guidance_scale.value !== "") body.guidance_scale = Number(f.guidance_scale.value);
  if (f.negative_prompt.value.trim() !== "") body.negative_prompt = f.negative_prompt.value;
  return body;
}

async function errorText(response) {
  try {
    const error = (await response.json()).error;
    return `${response.status}: ${error.message}` + (error.param ? ` (${error.param})` : "");
  } catch {
    return `HTTP ${response.status}`;
  }
}

async function post(body) {
  return fetch("v1/images/generations", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
}

// --- invariance state: /health, then each response's headers and `invariance` -------------------------------
function stageRow(stage) {
  return document.querySelector(`#invariance tr[data-stage="${stage}"]`);
}

function showSwitch(stage, on) {
  const cell = stageRow(stage).querySelector(".switch");
  cell.textContent = on ? "on" : "off";
  cell.className = `switch ${on ? "good" : "bad"}`;
}

// Whether an audit covers every replica's configuration, and if not, why (each replica's differences).
function showScope(cell, health) {
  if (health.verified === undefined || health.verified === null) {
    cell.textContent = "not reported";
    return;
  }
  cell.textContent = health.verified ? "verified" : "unverified";
  const why = [...new Set(Object.values(health.scope || {}).flatMap((verdict) => verdict.differences || []))];
  if (why.length) {
    const note = document.createElement("small");
    note.textContent = why.join("; ");
    cell.append(" ", note);
  }
}

async function refreshHealth() {
  try {
    const report = await (await fetch("health")).json();
    for (const [stage, health] of Object.entries(report.stages || {})) {
      const row = stageRow(stage);
      if (!row) continue;
      showSwitch(stage, health.batch_invariant);
      row.querySelector(".kernels").textContent = health.kernel_backend || "stock";
      row.querySelector(".state").textContent = health.state + (health.reasons?.length ? ` (${health.reasons.join("; ")})` : "");
      showScope(row.querySelector(".verified"), health);
    }
  } catch (error) {
    say(`health unavailable: ${error}`, "bad");
  }
}

function showInvariance(response, json) {
  for (const [stage, header] of Object.entries(STAGE_HEADERS)) {
    const value = response.headers.get(header);
    if (value !== null) showSwitch(stage, value === "true");
    const used = json?.invariance?.[stage];
    if (used?.kernel_backend) stageRow(stage).querySelector(".kernels").textContent = used.kernel_backend;
  }
}

// --- cards -------------------------------------------------------------------------------------------------
function field(card, name, value) {
  card.querySelector(`.${name}`).textContent = value ?? "-";
}

function newCard(index) {
  const card = document.createElement("figure");
  card.className = "card pending";
  card.dataset.index = index;
  card.innerHTML = `
    <div class="frame"><img alt="image ${index}"><span class="placeholder">waiting</span></div>
    <div class="partials" aria-label="partial images"></div>
    <figcaption><dl>
      <dt>seed</dt><dd class="seed">-</dd>
      <dt>sha256</dt><dd class="sha256">-</dd>
      <dt>revised prompt</dt><dd class="revised">-</dd>
      <dt>batch size</dt><dd class="batch">-</dd>
      <dt>replica</dt><dd class="replica">-</dd>
    </dl>
    <button type="button" class="reproduce" disabled>reproduce</button> <span class="verdict"></span></figcaption>`;
  results.appendChild(card);
  return card;
}

function showPartial(card, event) {
  const img = document.createElement("img");
  img.src = `data:image/png;base64,${event.b64_json}`;
  img.alt = `partial ${event.partial_image_index}`;
  img.title = `partial image ${event.partial_image_index}`;
  card.querySelector(".partials").appendChild(img);
  card.querySelector(".frame img").src = img.src; // the latest partial stands in until the image is done
  card.querySelector(".placeholder").textContent = `partial ${event.partial_image_index}`;
}

function showImage(card, image, body) {
  card.querySelector(".frame img").src = `data:image/png;base64,${image.b64_json}`;
  card.querySelector(".placeholder").remove();
  card.classList.remove("pending");
  field(card, "seed", image.seed);
  field(card, "sha256", image.sha256);
  card.querySelector(".sha256").title = image.sha256 ?? "";
  field(card, "revised", image.revised_prompt);
  field(card, "batch", image.batch_size);
  field(card, "replica", image.replica);
  const button = card.querySelector(".reproduce");
  button.disabled = image.seed === undefined || !image.sha256;
  button.onclick = () => reproduce(card, body, image);
}

// Image i alone: n=1 with its own seed (s_i), everything else as sent; its sha256 must be the same.
async function reproduce(card, body, image) {
  const verdict = card.querySelector(".verdict");
  const button = card.querySelector(".reproduce");
  button.disabled = true;
  verdict.textContent = "rendering again...";
  verdict.className = "verdict";
  try {
    const response = await post({ ...body, n: 1, seed: image.seed });
    if (!response.ok) throw new Error(await errorText(response));
    const again = (await response.json()).data[0];
    const same = again.sha256 === image.sha256;
    verdict.textContent = same ? "identical" : "differs";
    verdict.title = `reproduced sha256 ${again.sha256}`;
    verdict.className = `verdict ${same ? "good" : "bad"}`;
  } catch (error) {
    verdict.textContent = `failed: ${error.message}`;
    verdict.className = "verdict bad";
  } finally {
    button.disabled = false;
  }
}

// --- one generation: streamed, or whole ----------------------------------------------------------------------
async function generateWhole(body, cards) {
  const response = await post(body);
  if (!response.ok) throw new Error(await errorText(response));
  const json = await response.json();
  showInvariance(response, json);
  json.data.forEach((image, i) => showImage(cards[i], image, body));
}

// Yields each server-sent event's JSON data as it arrives.
async function* serverSentEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const lines = buffer.slice(0, end).split("\n");
      buffer = buffer.slice(end + 2);
      const data = lines.filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (data && data !== "[DONE]") yield JSON.parse(data);
    }
  }
}

// Which image an event is about: its index when the server sends one, else the first image not completed yet.
function eventIndex(event, completed) {
  return event.image_index ?? event.index ?? completed;
}

async function generateStreamed(body, cards, partials) {
  const response = await post({ ...body, stream: true, partial_images: partials });
  const type = response.headers.get("content-type") || "";
  if (!response.ok || !type.startsWith("text/event-stream")) {
    return { streamed: false, why: response.ok ? `answered ${type}` : await errorText(response) };
  }
  showInvariance(response, null);
  let completed = 0;
  let partialCount = 0;
  for await (const event of serverSentEvents(response)) {
    const card = cards[eventIndex(event, completed)];
    if (event.type === "image_generation.partial_image") {
      showPartial(card, event);
      say(`streaming: ${++partialCount} partial image(s), ${completed}/${cards.length} done`);
    } else if (event.type === "image_generation.completed") {
      showImage(card, event, body);
      completed += 1;
    } else if (event.type === "error" || event.error) {
      throw new Error(event.error?.message || JSON.stringify(event));
    }
  }
  if (completed < cards.length) throw new Error(`the stream ended after ${completed} of ${cards.length} images`);
  return { streamed: true };
}

function freshCards(n) {
  results.replaceChildren();
  return Array.from({ length: n }, (_, i) => newCard(i));
}

async function generate(event) {
  event.preventDefault();
  const body = requestBody();
  const partials = Number(form.elements.partial_images.value);
  const run = document.getElementById("run");
  run.disabled = true;
  const started = performance.now();
  say("generating...");
  try {
    let note = "";
    let outcome = { streamed: false, why: "no partial images asked for" };
    if (partials > 0) {
      try {
        outcome = await generateStreamed(body, freshCards(body.n), partials);
      } catch (error) {
        outcome = { streamed: false, why: error.message };
      }
      if (!outcome.streamed) note = ` (not streamed: ${outcome.why})`;
    }
    if (!outcome.streamed) await generateWhole(body, freshCards(body.n));
    say(`${body.n} image(s) in ${((performance.now() - started) / 1000).toFixed(1)} s${note}`, "good");
  } catch (error) {
    say(`failed: ${error.message}`, "bad");
  } finally {
    run.disabled = false;
  }
}

// --- a video: POST v1/videos (the form's fields but n and partial images), polled, then its MP4 played ---------
function newVideoCard() {
  const card = document.createElement("figure");
  card.className = "card pending video";
  card.innerHTML = `
    <div class="frame"><video controls loop muted playsinline aria-label="the video"></video><span class="placeholder">queued</span></div>
    <figcaption><dl>
      <dt>seed</dt><dd class="seed">-</dd>
      <dt>frames</dt><dd class="frames">-</dd>
      <dt>sha256</dt><dd class="sha256">-</dd>
      <dt>revised prompt</dt><dd class="revised">-</dd>
      <dt>batch size</dt><dd class="batch">-</dd>
    </dl><span class="verdict"></span></figcaption>`;
  results.replaceChildren(card);
  return card;
}

async function answer(response) {
  if (!response.ok) throw new Error(await errorText(response));
  return response;
}

async function pollVideo(card, job) {
  while (job.status === "queued" || job.status === "in_progress") {
    card.querySelector(".placeholder").textContent = `${job.status.replace("_", " ")} ${job.progress}%`;
    say(`video ${job.status.replace("_", " ")}: ${job.progress}%`);
    await new Promise((resolve) => setTimeout(resolve, 200));
    job = await (await answer(await fetch(`v1/videos/${job.id}`))).json();
  }
  if (job.status === "failed") throw new Error(`${job.error.message}` + (job.error.param ? ` (${job.error.param})` : ""));
  return job;
}

// The file's own sha256, computed here, against the job's: the bytes played are the bytes the server made.
async function showVideo(card, job, mp4) {
  const digest = Array.from(new Uint8Array(await crypto.subtle.digest("SHA-256", mp4)), (b) => b.toString(16).padStart(2, "0")).join("");
  const video = card.querySelector("video");
  video.src = URL.createObjectURL(new Blob([mp4], { type: "video/mp4" }));
  video.play().catch(() => {}); // autoplay may be refused; the controls remain
  card.querySelector(".placeholder").remove();
  card.classList.remove("pending");
  field(card, "seed", job.seed);
  field(card, "frames", `${job.num_frames} (${job.seconds} s at ${job.fps} fps)`);
  field(card, "sha256", digest);
  field(card, "revised", job.revised_prompt);
  field(card, "batch", job.batch_size);
  const verdict = card.querySelector(".verdict");
  verdict.textContent = digest === job.sha256 ? "file matches its sha256" : "file differs from its sha256";
  verdict.className = `verdict ${digest === job.sha256 ? "good" : "bad"}`;
}

async function makeVideo() {
  const { n, response_format, ...body } = requestBody(); // eslint-disable-line no-unused-vars
  const run = document.getElementById("run-video");
  run.disabled = true;
  const started = performance.now();
  const card = newVideoCard();
  try {
    const created = await answer(await fetch("v1/videos", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    }));
    const job = await pollVideo(card, await created.json());
    const mp4 = await (await answer(await fetch(`v1/videos/${job.id}/content`))).arrayBuffer();
    await showVideo(card, job, mp4);
    say(`a video of ${job.num_frames} frames in ${((performance.now() - started) / 1000).toFixed(1)} s`, "good");
  } catch (error) {
    say(`failed: ${error.message}`, "bad");
  } finally {
    run.disabled = false;
  }
}

form.addEventListener("submit", generate);
document.getElementById("run-video").addEventListener("click", makeVideo);
document.getElementById("new-seed").addEventListener("click", () => { form.elements.seed.value = randomSeed(); });
document.getElementById("refresh-health").addEventListener("click", refreshHealth);
form.elements.seed.value = randomSeed();
refreshHealth();
