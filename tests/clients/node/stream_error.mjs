// One streamed chat request through a real client; prints what the client saw as JSON.
// usage: node stream_error.mjs <client> ; env BOURSE_URL (…/v1), BOURSE_KEY, BOURSE_MODEL
// clients: openai (the openai package), ai-openai (the AI SDK's streamText with
// @ai-sdk/openai's .chat()), ai-compatible (the AI SDK with @ai-sdk/openai-compatible).
import OpenAI from "openai";
import { streamText } from "ai";
import { createOpenAI } from "@ai-sdk/openai";
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";

const [client] = process.argv.slice(2);
const baseURL = process.env.BOURSE_URL;
const apiKey = process.env.BOURSE_KEY;
const model = process.env.BOURSE_MODEL;
const messages = [{ role: "user", content: "Tell me something about rivers." }];

async function viaOpenAI() {
  const sdk = new OpenAI({ baseURL, apiKey, maxRetries: 0 });
  let text = "";
  try {
    const stream = await sdk.chat.completions.create({ model, messages, stream: true });
    for await (const chunk of stream) text += chunk.choices[0]?.delta?.content ?? "";
    return { raised: false, text };
  } catch (error) {
    return { raised: true, text, error: String(error?.message ?? error) };
  }
}

async function viaAiSdk(languageModel) {
  const onError = [];
  const errorParts = [];
  let text = "";
  let thrown = null;
  const result = streamText({
    model: languageModel,
    messages,
    maxRetries: 0,
    onError: ({ error }) => onError.push(String(error?.message ?? error)),
  });
  try {
    for await (const part of result.fullStream) {
      if (part.type === "text-delta") text += part.text;
      if (part.type === "error") errorParts.push(String(part.error?.message ?? JSON.stringify(part.error)));
    }
  } catch (error) {
    thrown = String(error?.message ?? error);
  }
  let finishReason;
  try {
    finishReason = await result.finishReason;
  } catch (error) {
    finishReason = `rejected: ${error?.message ?? error}`;
  }
  const raised = thrown !== null || errorParts.length > 0 || onError.length > 0;
  return { raised, text, thrown, errorParts, onError, finishReason };
}

let out;
if (client === "openai") {
  out = await viaOpenAI();
} else if (client === "ai-openai") {
  out = await viaAiSdk(createOpenAI({ baseURL, apiKey }).chat(model));
} else if (client === "ai-compatible") {
  out = await viaAiSdk(createOpenAICompatible({ name: "bourse", baseURL, apiKey }).chatModel(model));
} else {
  throw new Error(`unknown client ${client}`);
}
process.stdout.write(JSON.stringify(out) + "\n");
