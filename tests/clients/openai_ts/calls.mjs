// OpenAI's official TypeScript SDK (the npm package `openai`, the exact version package-lock.json pins) driving a
// running omniserve as a Node client would: models, images (n=2 reproduced with its seed, streamed, edited), a 400
// naming its field, a chat completion streamed and not, and a video job rendered twice to the same bytes.
//
//   node tests/clients/openai_ts/calls.mjs <base-url> [<sdk-dir>]
//
// <base-url> is the app's root (http://127.0.0.1:8000); <sdk-dir> is where `make openai-ts` ran `npm ci`
// (build/openai-ts by default). Plain JavaScript (ESM): nothing to compile. Each call is one named check; the last line
// on stdout is a JSON summary {ok, sdk, node, checks: [{name, ok, detail | error}]}; exit 0 only when every check passed.
// Repeats that must render again (not be answered from the server's result cache) send `Cache-Control: no-cache`.

import { createHash } from 'node:crypto';
import { existsSync, readFileSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { deflateSync } from 'node:zlib';

const HERE = dirname(fileURLToPath(import.meta.url));
const [baseArg, sdkArg] = process.argv.slice(2);
if (!baseArg) {
  console.error('usage: node calls.mjs <base-url> [<sdk-dir>]');
  process.exit(2);
}
const BASE = baseArg.replace(/\/+$/, '');
const SDK_DIR = resolve(sdkArg ?? join(HERE, '..', '..', '..', 'build', 'openai-ts'));
const SDK_PACKAGE = join(SDK_DIR, 'node_modules', 'openai', 'package.json');
if (!existsSync(SDK_PACKAGE)) {
  console.error(`the openai SDK is not installed in ${SDK_DIR}: run \`make openai-ts\``);
  process.exit(2);
}
const sdkPackage = JSON.parse(readFileSync(SDK_PACKAGE, 'utf8'));
// The SDK's multipart uploads need a global `File` (Node 20 and later have one). The 7.x line declares Node >= 22, but
// Debian 12's nodejs is 18.20: there the SDK's own error says to set it from node:buffer, which is what a Node 18 client
// does; the summary says when it was set.
const notes = [];
if (globalThis.File === undefined) {
  globalThis.File = (await import('node:buffer')).File;
  notes.push(`node ${process.version} has no global File: set from node:buffer for the SDK's uploads`);
}
const entry = sdkPackage.exports['.'].import ?? sdkPackage.exports['.'].default; // the package's own ESM entry
const { default: OpenAI, toFile, BadRequestError } = await import(pathToFileURL(join(dirname(SDK_PACKAGE), entry)).href);

const SIZE = '64x64';
const STEPS = 2; // few denoising steps: the checks are about the API, not the pictures
const FRESH = { headers: { 'Cache-Control': 'no-cache' } }; // render again, whatever the server keeps
const TIMEOUT_MS = 180_000;
const client = new OpenAI({ baseURL: `${BASE}/v1`, apiKey: 'unused', maxRetries: 0, timeout: TIMEOUT_MS });

const sha256 = (bytes) => createHash('sha256').update(bytes).digest('hex');
const b64 = (item) => Buffer.from(item.b64_json, 'base64');
const rendered = (item) => item.cache !== 'hit'; // not answered from the result cache (absent where it keeps none)
const isPng = (bytes) => bytes.subarray(0, 8).equals(Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]));

function expect(condition, message) {
  if (!condition) throw new Error(message);
}

/** An image item's bytes: a PNG whose sha256 is the one the server says it rendered. */
function png(item, what) {
  const bytes = b64(item);
  expect(isPng(bytes), `${what}: b64_json is not a PNG`);
  expect(sha256(bytes) === item.sha256, `${what}: the bytes' sha256 ${sha256(bytes)} is not the item's ${item.sha256}`);
  return bytes;
}

const checks = [];
/** Run one named check; a failure is recorded with its error (status and param for an API error), never thrown. */
async function check(name, run) {
  const started = performance.now();
  try {
    const detail = (await run()) ?? {};
    checks.push({ name, ok: true, seconds: +((performance.now() - started) / 1000).toFixed(2), detail });
  } catch (err) {
    const api = err?.status !== undefined ? ` (HTTP ${err.status}, param ${err.param ?? '-'})` : '';
    checks.push({ name, ok: false, seconds: +((performance.now() - started) / 1000).toFixed(2), error: `${err?.message ?? err}${api}` });
  }
}

/** A small PNG made here (64x64, RGB, fixed pixels): the edit's input, whatever the other checks did. */
function makePng(width = 64, height = 64) {
  const table = Array.from({ length: 256 }, (_, n) => {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    return c >>> 0;
  });
  const crc = (bytes) => {
    let c = 0xffffffff;
    for (const b of bytes) c = table[(c ^ b) & 0xff] ^ (c >>> 8);
    return (c ^ 0xffffffff) >>> 0;
  };
  const chunk = (type, data) => {
    const body = Buffer.concat([Buffer.from(type, 'ascii'), data]);
    const out = Buffer.alloc(12 + data.length);
    out.writeUInt32BE(data.length, 0);
    body.copy(out, 4);
    out.writeUInt32BE(crc(body), 8 + data.length);
    return out;
  };
  const header = Buffer.alloc(13);
  header.writeUInt32BE(width, 0);
  header.writeUInt32BE(height, 4);
  header.set([8, 2, 0, 0, 0], 8); // 8 bits, RGB, deflate, no filter, no interlace
  const rows = Buffer.alloc(height * (1 + 3 * width));
  for (let y = 0; y < height; y++) {
    for (let x = 0; x < width; x++) {
      rows.set([(x * 4) & 0xff, (y * 4) & 0xff, ((x ^ y) * 8) & 0xff], y * (1 + 3 * width) + 1 + 3 * x);
    }
  }
  const signature = Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]);
  return Buffer.concat([signature, chunk('IHDR', header), chunk('IDAT', deflateSync(rows)), chunk('IEND', Buffer.alloc(0))]);
}

// --- models -------------------------------------------------------------------------------------------------------
let models = [];
await check('models.list', async () => {
  for await (const model of client.models.list()) models.push(model);
  const stages = Object.fromEntries(models.map((m) => [m.stage, m.id]));
  expect(stages.diffusion && stages.llm, `expected a diffusion and an llm model, got ${JSON.stringify(stages)}`);
  expect(models.every((m) => m.object === 'model'), 'every card is an object "model"');
  return { ids: models.map((m) => m.id) };
});

await check('models.retrieve', async () => {
  expect(models.length > 0, 'no models listed to retrieve');
  for (const listed of models) {
    const card = await client.models.retrieve(listed.id); // ids with a slash included
    expect(JSON.stringify(card) === JSON.stringify(listed), `${listed.id}: retrieved ${JSON.stringify(card)}, listed ${JSON.stringify(listed)}`);
  }
  return { retrieved: models.length };
});

// --- images -------------------------------------------------------------------------------------------------------
await check('images.generate n=2, same seed twice', async () => {
  const body = { prompt: 'a red fox in the snow, from the TypeScript SDK', n: 2, size: SIZE, response_format: 'b64_json',
                 seed: 4242, num_inference_steps: STEPS };
  const first = await client.images.generate(body);
  const again = await client.images.generate(body, FRESH);
  for (const result of [first, again]) expect(result.data.length === 2, `n=2 gave ${result.data.length} images`);
  const seeds = first.data.map((d) => d.seed);
  expect(new Set(seeds).size === 2, `the two images share a seed: ${seeds}`);
  expect(JSON.stringify(again.data.map((d) => d.seed)) === JSON.stringify(seeds), 'the repeat drew other seeds');
  expect(again.data.every(rendered), 'the repeat was answered from the result cache despite no-cache');
  first.data.forEach((item, i) => {
    const bytes = png(item, `first ${i}`);
    expect(bytes.equals(png(again.data[i], `again ${i}`)), `image ${i}: the repeat's bytes differ`);
  });
  expect(first.data.every((d) => d.revised_prompt), 'a revised prompt for each image (the LLM stage rewrote it)');
  return { seeds, sha256: first.data.map((d) => d.sha256) };
});

await check('images.generate stream partial_images', async () => {
  const body = { prompt: 'a paper lantern over a river', size: SIZE, seed: 77, num_inference_steps: 4 };
  const events = [];
  // no-cache: a kept image would be answered with its completed event alone, no partial images
  for await (const event of await client.images.generate({ ...body, stream: true, partial_images: 2 }, FRESH)) events.push(event);
  const types = events.map((e) => e.type);
  const partials = events.filter((e) => e.type === 'image_generation.partial_image');
  expect(types.at(-1) === 'image_generation.completed' && partials.length === types.length - 1 && partials.length >= 1,
         `events ${JSON.stringify(types)}`);
  expect(partials.every((e, i) => e.partial_image_index === i && isPng(b64(e))), 'partial images indexed 0.. and PNGs');
  const completed = events.at(-1);
  expect(completed.size === SIZE && completed.output_format === 'png', `completed: size ${completed.size}, format ${completed.output_format}`);
  const whole = await client.images.generate(body, FRESH); // the same request, not streamed
  const bytes = png(whole.data[0], 'not streamed');
  expect(rendered(whole.data[0]), 'the non-streamed image was answered from the result cache despite no-cache');
  expect(b64(completed).equals(bytes), "the completed event's bytes are not the non-streamed image's");
  expect(completed.sha256 === whole.data[0].sha256 && completed.seed === 77, 'the completed event names another sha256 or seed');
  return { events: types.length, partials: partials.length, sha256: completed.sha256 };
});

await check('images.edit multipart', async () => {
  const input = makePng();
  const body = { image: await toFile(input, 'in.png', { type: 'image/png' }), prompt: 'the same square, at night', n: 1,
                 size: SIZE, seed: 5150, num_inference_steps: STEPS, enhance_prompt: false };
  const first = await client.images.edit(body);
  const again = await client.images.edit(body, FRESH);
  expect(first.data.length === 1, `n=1 gave ${first.data.length} images`);
  const bytes = png(first.data[0], 'edit');
  expect(bytes.equals(png(again.data[0], 'edit again')), "the repeated edit's bytes differ");
  expect(rendered(again.data[0]), 'the repeated edit was answered from the result cache despite no-cache');
  expect(first.data[0].seed === 5150, `the edit's seed is ${first.data[0].seed}`);
  return { input_sha256: sha256(input), sha256: first.data[0].sha256 };
});

await check('images.generate invalid size is a 400 naming size', async () => {
  try {
    await client.images.generate({ prompt: 'a fox', size: '60x60', seed: 1 });
  } catch (err) {
    expect(err instanceof BadRequestError && err.status === 400, `expected a BadRequestError (400), got ${err?.constructor?.name} ${err?.status}: ${err?.message}`);
    expect(err.param === 'size', `the error names ${err.param}, not size: ${err.message}`);
    return { status: err.status, param: err.param, message: err.error?.message };
  }
  throw new Error('size 60x60 was accepted');
});

// --- chat ---------------------------------------------------------------------------------------------------------
await check('chat.completions stream equals non-streamed, with usage', async () => {
  const llm = models.find((m) => m.stage === 'llm')?.id ?? 'llm';
  const body = { model: llm, messages: [{ role: 'user', content: 'a red fox in the snow' }], max_tokens: 24, seed: 11,
                 temperature: 0.9 };
  const whole = await client.chat.completions.create(body, FRESH);
  expect(whole.cache !== 'hit', 'the completion was answered from the result cache despite no-cache');
  const chunks = [];
  const stream = await client.chat.completions.create({ ...body, stream: true, stream_options: { include_usage: true } }, FRESH);
  for await (const chunk of stream) chunks.push(chunk);
  expect(chunks[0]?.choices[0]?.delta?.role === 'assistant', 'the first chunk names the role');
  const text = chunks.map((c) => c.choices[0]?.delta?.content ?? '').join('');
  expect(text === whole.choices[0].message.content, `streamed ${JSON.stringify(text)}, not ${JSON.stringify(whole.choices[0].message.content)}`);
  const finish = chunks.flatMap((c) => c.choices.map((choice) => choice.finish_reason).filter(Boolean));
  expect(JSON.stringify(finish) === JSON.stringify([whole.choices[0].finish_reason]), `finish reasons ${finish}`);
  const last = chunks.at(-1);
  expect(last.choices.length === 0 && last.usage, 'the last chunk carries the usage and no choices');
  for (const key of ['prompt_tokens', 'completion_tokens', 'total_tokens']) {
    expect(last.usage[key] === whole.usage[key], `usage.${key}: streamed ${last.usage[key]}, not ${whole.usage[key]}`);
  }
  expect(new Set(chunks.map((c) => c.id)).size === 1 && chunks.every((c) => c.object === 'chat.completion.chunk'), 'one id, chunk objects');
  return { chunks: chunks.length, usage: last.usage, finish_reason: whole.choices[0].finish_reason };
});

// --- videos -------------------------------------------------------------------------------------------------------
async function renderVideo() {
  const created = await client.videos.create({ prompt: 'a paper boat on a pond, from the TypeScript SDK', seconds: '1',
                                               size: SIZE, seed: 2718, num_inference_steps: STEPS }); // multipart
  expect(created.object === 'video' && created.id, `created ${JSON.stringify(created)}`);
  const deadline = Date.now() + TIMEOUT_MS;
  let video = created;
  while (!['completed', 'failed'].includes(video.status)) {
    expect(Date.now() < deadline, `video ${created.id} not finished after ${TIMEOUT_MS / 1000} s (${video.status})`);
    await new Promise((done) => setTimeout(done, 100));
    video = await client.videos.retrieve(created.id);
  }
  expect(video.status === 'completed', `video ${created.id} ${video.status}: ${JSON.stringify(video.error)}`);
  const mp4 = Buffer.from(await (await client.videos.downloadContent(created.id)).arrayBuffer());
  expect(sha256(mp4) === video.sha256, `the downloaded file's sha256 ${sha256(mp4)} is not the job's ${video.sha256}`);
  expect(mp4.subarray(4, 8).toString('ascii') === 'ftyp', 'the download is not an MP4');
  return { video, mp4 };
}

await check('videos create/retrieve/downloadContent twice, same sha256', async () => {
  const first = await renderVideo();
  const again = await renderVideo();
  expect(first.video.id !== again.video.id, 'the second create returned the first job');
  expect(first.mp4.equals(again.mp4), `same request and seed, other bytes: ${first.video.sha256} != ${again.video.sha256}`);
  for (const { video } of [first, again]) {
    const deleted = await client.videos.delete(video.id);
    expect(deleted.deleted === true && deleted.id === video.id, `delete ${video.id}: ${JSON.stringify(deleted)}`);
  }
  return { ids: [first.video.id, again.video.id], sha256: first.video.sha256, frames: first.video.num_frames, bytes: first.mp4.length };
});

const summary = { ok: checks.every((c) => c.ok), sdk: `openai ${sdkPackage.version}`, node: process.version, base_url: BASE, notes,
                  checks };
console.log(JSON.stringify(summary));
process.exit(summary.ok ? 0 : 1);
