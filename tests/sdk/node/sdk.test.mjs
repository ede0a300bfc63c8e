// The official OpenAI Node SDK (openai@6) against a running Switchyard gateway.
// Needs GATEWAY_URL and MODEL (set by scripts/sdk-tests.sh).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import OpenAI from 'openai';

const MODEL = process.env.MODEL;
const client = new OpenAI({
  baseURL: `${process.env.GATEWAY_URL}/v1`,
  apiKey: 'sk-client-key',
  maxRetries: 0,
});

test('models list contains the served model', async () => {
  const ids = [];
  for await (const m of client.models.list()) ids.push(m.id);
  assert.ok(ids.includes(MODEL), `models: ${ids}`);
});

test('chat, non-streaming', async () => {
  const r = await client.chat.completions.create({
    model: MODEL,
    messages: [{ role: 'user', content: 'Say something.' }],
    max_tokens: 8,
  });
  assert.equal(r.object, 'chat.completion');
  assert.ok(r.choices[0].message.content.length > 0);
  assert.equal(r.usage.completion_tokens, 8);
});

test('chat, streaming with usage', async () => {
  const stream = await client.chat.completions.create({
    model: MODEL,
    messages: [{ role: 'user', content: 'Stream please.' }],
    max_tokens: 6,
    stream: true,
    stream_options: { include_usage: true },
  });
  let pieces = 0;
  let usage = null;
  for await (const chunk of stream) {
    if (chunk.choices.length && chunk.choices[0].delta.content) pieces += 1;
    if (chunk.usage) usage = chunk.usage;
  }
  assert.equal(pieces, 6);
  assert.equal(usage.completion_tokens, 6);
});

test('completions', async () => {
  const r = await client.completions.create({ model: MODEL, prompt: 'Once upon a time', max_tokens: 5 });
  assert.equal(r.object, 'text_completion');
  assert.ok(r.choices[0].text.length > 0);
});

test('embeddings', async () => {
  const r = await client.embeddings.create({ model: MODEL, input: 'hello' });
  assert.equal(r.data.length, 1);
  assert.ok(r.data[0].embedding.length > 0);
});

test('unknown model raises NotFoundError', async () => {
  await assert.rejects(
    client.chat.completions.create({ model: 'no-such-model', messages: [{ role: 'user', content: 'x' }] }),
    (e) => e instanceof OpenAI.NotFoundError && e.status === 404,
  );
});

test('models.retrieve', async () => {
  const m = await client.models.retrieve(MODEL);
  assert.equal(m.id, MODEL);
  await assert.rejects(client.models.retrieve('no-such-model'), (e) => e instanceof OpenAI.NotFoundError);
});

test('responses, streaming', async () => {
  const stream = await client.responses.create({ model: MODEL, input: 'Stream a story.', max_output_tokens: 4, stream: true });
  const types = [];
  for await (const e of stream) types.push(e.type);
  assert.equal(types.filter((t) => t === 'response.output_text.delta').length, 4);
  assert.equal(types.at(-1), 'response.completed');
});
