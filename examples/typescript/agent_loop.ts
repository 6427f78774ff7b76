// An agent loop on compactd, in TypeScript: PrepareStep before every model call.
//
// For each turn of the script: open the turn, then step until the model answers without tool
// calls. Each step asks compactd to prepare it (PrepareStep prunes and compacts when the request
// is above pressure, streaming each bracket step; the client holds the request and compactd
// answers only what the step added), sends the request compactd rebuilt to the
// model (an OpenAI-compatible endpoint), logs the reply with its usage, runs the tools (scripted:
// the recorded outputs) and logs their results. Prints pressure per step, every compaction, and
// the final surface. Run through examples/run (it starts compactd and the scripted model).

import { readFileSync } from "node:fs";
import {
  type BuildRequestResponse,
  CompactdClient,
  type CompactionProgress,
  CompactionStep,
  eventType,
  type JsonObject,
  MeasurementMethod,
  openai,
  PressureState,
  type PressureReport,
  requestHeader,
  type SessionEvent,
  stepEnd,
  stepStart,
  systemMessage,
  toolDeclaration,
  toolResult,
  turnEnd,
  turnStart,
  userMessage,
} from "../../clients/typescript/lib/index.js";

interface Script {
  source: string;
  system: string;
  turns: Array<{ user: string }>;
  tool_results: Record<string, string>;
  tools: Array<{ name: string; description: string; input_schema: object }>;
}

interface WireCall {
  id: string;
  type: "function";
  function: { name: string; arguments: string };
}

interface Completion {
  choices: Array<{
    message: { content: string | null; tool_calls?: WireCall[] };
    finish_reason: string | null;
  }>;
  usage?: {
    prompt_tokens?: number;
    completion_tokens?: number;
    prompt_tokens_details?: { cached_tokens?: number };
  };
}

async function complete(baseUrl: string, body: object): Promise<Completion> {
  const response = await fetch(`${baseUrl}/chat/completions`, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
  });
  if (!response.ok) throw new Error(`model answered HTTP ${response.status}`);
  return (await response.json()) as Completion;
}

function pressureLine(
  label: string,
  report: PressureReport | undefined,
): string {
  if (!report) return `${label} pressure unknown`;
  const state = PressureState[report.state];
  const method =
    MeasurementMethod[
      report.breakdown?.method ?? MeasurementMethod.UNSPECIFIED
    ];
  return `${label} pressure ${report.measuredTokens}/${report.triggerTokens} ${state} (${method})`;
}

function progressLine(p: CompactionProgress): string {
  return `    ${CompactionStep[p.step].toLowerCase().padEnd(9)} seq=${p.seq} ${p.detail}`.trimEnd();
}

class Agent {
  private readonly provider = process.env.COMPACTD_PROVIDER ?? "";
  private readonly model = process.env.COMPACTD_MODEL ?? "";
  private readonly baseUrl = process.env.COMPACTD_AGENT_BASE_URL ?? "";
  private sessionId = "";
  private steps = 0;
  private compactions = 0;
  private prunes = 0;

  constructor(
    private readonly client: CompactdClient,
    private readonly script: Script,
  ) {}

  /** Creates the session and logs the system prompt and the request header. */
  async openSession(): Promise<void> {
    this.sessionId = (await this.client.createSession()).sessionId;
    console.log(`session ${this.sessionId}: ${this.script.source}`);
    const tools = this.script.tools.map((t) =>
      toolDeclaration(t.name, t.description, t.input_schema),
    );
    await this.client.appendEvents(this.sessionId, [
      systemMessage(this.script.system),
      requestHeader(this.provider, this.model, { tools }),
    ]);
  }

  /** Opens the turn, steps until the model stops calling tools, closes the turn. */
  async runTurn(turn: number, userText: string): Promise<void> {
    await this.client.appendEvents(this.sessionId, [
      turnStart(turn),
      userMessage(userText),
    ]);
    for (let step = 1; await this.step(turn, step); step++);
    await this.client.appendEvents(this.sessionId, [
      turnEnd(turn, "completed"),
    ]);
  }

  /** One model call: prepare, send, log the reply and tool results. True if tools ran. */
  private async step(turn: number, step: number): Promise<boolean> {
    this.steps++;
    const request = await this.prepare(turn, step);
    // compactd rebuilt the request; the converter makes it a chat-completions body.
    const answer = await complete(
      this.baseUrl,
      openai.requestBody(request, { stream: false }),
    );
    const calls = answer.choices[0]?.message.tool_calls ?? [];
    const events: SessionEvent[] = [
      stepStart(turn, step),
      openai.assistantEvent(answer as unknown as JsonObject, {
        provider: this.provider,
      }),
    ];
    for (const call of calls) {
      const output =
        this.script.tool_results[call.id] ?? "(no output recorded)";
      events.push(
        toolResult(call.id, output, { toolName: call.function.name }),
      );
    }
    events.push(stepEnd(turn, step));
    await this.client.appendEvents(this.sessionId, events);
    return calls.length > 0;
  }

  /** PrepareStep: prints pressure and what compactd did; returns the request to send. */
  private async prepare(
    turn: number,
    step: number,
  ): Promise<BuildRequestResponse> {
    // The client holds the session's last request and sends its revision:
    // compactd answers only what this step added (or the full request after a
    // compaction).
    const updates: string[] = [];
    const prepared = await this.client.prepareStep(this.sessionId, turn, {
      onProgress: (progress) => updates.push(progressLine(progress)),
    });
    const result = prepared.result;
    this.prunes += Number(result.prunedCount);
    this.compactions += result.compactions.length;
    let line = pressureLine(
      `turn ${turn} step ${String(step).padStart(2)}`,
      result.before,
    );
    if (result.prunedCount > 0n || result.compactions.length > 0) {
      line += ` -> ${result.after?.measuredTokens} after ${result.prunedCount} pruned, ${result.compactions.length} compacted`;
    }
    console.log([line, ...updates].join("\n"));
    for (const o of result.compactions) {
      console.log(
        `    compaction ${o.compactionId}: ${o.itemsCondensed} items condensed, ~${o.tokensFreed} tokens freed`,
      );
    }
    for (const warning of result.warnings)
      console.log(`    warning: ${warning}`);
    return prepared.request;
  }

  /** Prints the totals, the final pressure and the final surface. */
  async report(): Promise<void> {
    const final = await this.client.checkPressure(this.sessionId);
    const surface = await this.client.getSurface(this.sessionId);
    console.log(
      `\n${this.steps} steps, ${this.compactions} compactions, ${this.prunes} tool results pruned`,
    );
    console.log(pressureLine("final", final));
    console.log(
      `surface at revision ${surface.revision}: ${surface.nodes.length} nodes`,
    );
    for (const node of surface.nodes) {
      const chars = (node.message?.content ?? []).reduce(
        (n, b) => n + (b.block.case === "text" ? b.block.value.text.length : 0),
        0,
      );
      const mark = node.compactionId ? ` checkpoint ${node.compactionId}` : "";
      console.log(
        `  ${String(node.position).padStart(3)} seq ${String(node.seq).padStart(4)} ${node.type.padEnd(18)} ${String(chars).padStart(6)} chars${mark}`,
      );
    }
    const log: string[] = [];
    for await (const event of this.client.listEvents(this.sessionId))
      log.push(eventType(event));
    console.log(
      `log: ${log.length} events, ${log.filter((t) => t === "compaction/start").length} brackets`,
    );
  }
}

async function main(): Promise<void> {
  const script = JSON.parse(
    readFileSync(process.env.COMPACTD_EXAMPLE_SCRIPT ?? "", "utf-8"),
  ) as Script;
  const client = new CompactdClient(process.env.COMPACTD_ADDRESS ?? "");
  try {
    const agent = new Agent(client, script);
    await agent.openSession();
    for (const [index, turn] of script.turns.entries())
      await agent.runTurn(index + 1, turn.user);
    await agent.report();
  } finally {
    client.close();
  }
}

await main();
