// One request through a real client's Responses API; prints what the client saw as JSON.
// usage: node responses.mjs <client> ; env BOURSE_URL (…/v1), BOURSE_KEY, BOURSE_MODEL
// clients: ai-stream and ai-generate (the AI SDK's streamText and generateText with the
// default provider, createOpenAI()(model), which speaks the Responses API), ai-multi-turn
// (two generateText turns, the second referencing the first answer), openai-stream
// (the openai package's responses.create({stream: true})).
import OpenAI from "openai";
import { generateText, streamText } from "ai";
import { createOpenAI } from "@ai-sdk/openai";

const [client] = process.argv.slice(2);
const baseURL = process.env.BOURSE_URL;
const apiKey = process.env.BOURSE_KEY;
const modelId = process.env.BOURSE_MODEL;
const prompt = "Tell me something about rivers.";

async function aiStream() {
  const errors = [];
  const result = streamText({
    model: createOpenAI({ baseURL, apiKey })(modelId),
    prompt,
    maxRetries: 0,
    onError: ({ error }) => errors.push(String(error?.message ?? error)),
  });
  let text = "";
  const parts = [];
  for await (const part of result.fullStream) {
    if (!parts.includes(part.type)) parts.push(part.type);
    if (part.type === "text-delta") text += part.text;
    if (part.type === "error") errors.push(String(part.error?.message ?? JSON.stringify(part.error)));
  }
  const response = await result.response;
  return {
    text,
    parts,
    errors,
    finishReason: await result.finishReason,
    usage: await result.usage,
    responseId: response.id,
  };
}

async function aiGenerate() {
  const result = await generateText({ model: createOpenAI({ baseURL, apiKey })(modelId), prompt, maxRetries: 0 });
  return { text: result.text, finishReason: result.finishReason, usage: result.usage, responseId: result.response.id };
}

async function aiMultiTurn() {
  // the second turn sends the first answer back as an item_reference (the provider's
  // default with store: true)
  const model = createOpenAI({ baseURL, apiKey })(modelId);
  const messages = [{ role: "user", content: prompt }];
  const first = await generateText({ model, messages, maxRetries: 0 });
  messages.push(...first.response.messages, { role: "user", content: "And then?" });
  const second = await generateText({ model, messages, maxRetries: 0 });
  const sent = typeof second.request.body === "string" ? JSON.parse(second.request.body) : second.request.body;
  return { first: first.text, second: second.text, input: sent.input, usage: second.usage };
}

async function openaiStream() {
  const sdk = new OpenAI({ baseURL, apiKey, maxRetries: 0 });
  const stream = await sdk.responses.create({ model: modelId, input: prompt, stream: true });
  const types = [];
  const sequence = [];
  let text = "";
  let final = null;
  for await (const event of stream) {
    types.push(event.type);
    sequence.push(event.sequence_number);
    if (event.type === "response.output_text.delta") text += event.delta;
    if (event.type === "response.completed") final = event.response;
  }
  return { types, sequence, text, id: final?.id, status: final?.status, output: final?.output, usage: final?.usage };
}

const clients = {
  "ai-stream": aiStream,
  "ai-generate": aiGenerate,
  "ai-multi-turn": aiMultiTurn,
  "openai-stream": openaiStream,
};
if (!(client in clients)) throw new Error(`unknown client ${client}`);
process.stdout.write(JSON.stringify(await clients[client]()) + "\n");
