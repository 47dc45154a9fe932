'use strict';
/**
 * A dm_env_rpc v1 test server on Node.js @grpc/grpc-js: a gRPC stack that shares no HTTP/2 or
 * protobuf code with grpcio (tests/test_node_server.py drives the SDK against it).
 *
 * It loads the repository's own protos/ with @grpc/proto-loader and serves Catch-like worlds:
 * a ball falls one row a step from a seeded random column of the top row; the paddle moves
 * along the bottom row; reaching the bottom ends the episode (TERMINATED) with reward +1 under
 * the paddle, -1 elsewhere.
 *
 *   action      paddle  (UID 1) int8 [], bounds [-1, 1]
 *   observation board   (UID 1) float32 [rows, columns], bounds [0, 1]
 *               reward  (UID 2) float32 []
 *               discount(UID 3) float32 [], bounds [0, 1]
 *   settings    CreateWorld: seed (0), rows (10), columns (5), max_steps (none: INTERRUPTED
 *               after that many steps), num_agents (1); Reset and ResetWorld: seed;
 *               JoinWorld: agent (an index; default the lowest free one)
 *
 * A world of num_agents >= 2 is a multi-agent world: one JoinWorld per stream, each agent with
 * a paddle of its own under one falling ball (its board shows the ball and its own paddle; its
 * reward is +1 if the ball lands on its paddle, -1 elsewhere). Its step is lockstep: an
 * agent's StepRequest is answered only once every joined agent has sent one (the later
 * requests of a waiting stream wait behind it); a step that waits longer than --agent-timeout
 * seconds is answered DEADLINE_EXCEEDED naming the agents that did not act. ResetWorld makes
 * every joined agent's next step INTERRUPTED when a sequence is running (then the next starts);
 * a leave frees the agent's place and the others go on (a barrier waiting only for it
 * completes); DestroyWorld while any agent is joined is FAILED_PRECONDITION. A taken agent is
 * ALREADY_EXISTS, one out of range INVALID_ARGUMENT, a full world RESOURCE_EXHAUSTED.
 *
 * The protocol as WIRE.md has it: many worlds and streams at once, requests answered in order
 * as they come (pipelining), errors as google.rpc.Status in the response's `error` field (the
 * stream goes on), and worlds kept until a DestroyWorldRequest (a stream that ends only
 * leaves its world).
 *
 * protobufjs gives the keys of a map<uint64, ...> as 8-byte "long hash" strings, whatever the
 * `longs` option; requests' keys are turned back into decimal strings here (`decimalKeys`),
 * and responses are written with decimal string keys, which protobufjs's encoder parses.
 *
 * Usage: node server.js --proto-root DIR --include DIR [--port 0] [--host 127.0.0.1]
 *          [--max-concurrent-streams N] [--max-worlds N] [--agent-timeout SECONDS (30)]
 * Prints one line `{"port": N}` on stdout once it listens. It exits when its stdin closes or
 * its parent process changes (the process that started it died, even by SIGKILL).
 */

const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');

const CODE = {
  INVALID_ARGUMENT: 3,
  DEADLINE_EXCEEDED: 4,
  ALREADY_EXISTS: 6,
  NOT_FOUND: 5,
  FAILED_PRECONDITION: 9,
  RESOURCE_EXHAUSTED: 8,
  UNIMPLEMENTED: 12,
};
const STATE = { RUNNING: 1, TERMINATED: 2, INTERRUPTED: 3 };
const DTYPE = { FLOAT: 1, INT8: 3 };
const UID = { paddle: '1', board: '1', reward: '2', discount: '3' };

function parseArgs(argv) {
  const args = {
    port: 0, host: '127.0.0.1', protoRoot: null, include: [], maxStreams: 0, maxWorlds: 0, agentTimeout: 30,
  };
  for (let i = 0; i < argv.length; i += 2) {
    const [flag, value] = [argv[i], argv[i + 1]];
    if (value === undefined) throw new Error(`${flag} needs a value`);
    if (flag === '--port') args.port = Number(value);
    else if (flag === '--host') args.host = value;
    else if (flag === '--proto-root') args.protoRoot = value;
    else if (flag === '--include') args.include.push(value);
    else if (flag === '--max-concurrent-streams') args.maxStreams = Number(value);
    else if (flag === '--max-worlds') args.maxWorlds = Number(value);
    else if (flag === '--agent-timeout') args.agentTimeout = Number(value);
    else throw new Error(`unknown flag ${flag}`);
  }
  if (!args.protoRoot) throw new Error('--proto-root DIR (the repository protos/) is required');
  return args;
}

/** A 64-bit map key as protobufjs decodes it (an 8-byte hash string) in decimal. */
function decimalKey(key) {
  if (typeof key !== 'string' || key.length !== 8) return String(key);
  const bits = protobuf.util.LongBits.fromHash(key);
  return ((BigInt(bits.hi >>> 0) << 32n) | BigInt(bits.lo >>> 0)).toString();
}

function decimalKeys(map) {
  const out = {};
  for (const key of Object.keys(map || {})) out[decimalKey(key)] = map[key];
  return out;
}

/** Mulberry32: a small seeded RNG, so that a world's episodes repeat for its seed. */
function rng(seed) {
  let a = (Number(BigInt.asUintN(32, BigInt(seed))) ^ 0x9e3779b9) >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

class StatusError extends Error {
  constructor(code, message) {
    super(message);
    this.code = code;
  }
}

const INTEGER_PAYLOADS = ['int8s', 'int32s', 'int64s', 'uint8s', 'uint32s', 'uint64s'];

/** The one integer of a settings Tensor. */
function integerSetting(name, tensor, minimum) {
  const kind = tensor && tensor.payload;
  if (!INTEGER_PAYLOADS.includes(kind)) {
    throw new StatusError(CODE.INVALID_ARGUMENT, `setting '${name}' must be an integer, got ${kind || 'no payload'}`);
  }
  const values = Array.from(tensor[kind].array || []);
  if (values.length !== 1) {
    throw new StatusError(CODE.INVALID_ARGUMENT, `setting '${name}' must hold one integer, got ${values.length}`);
  }
  let value = Number(values[0]);
  if (kind === 'int8s' && value > 127) value -= 256;
  if (!Number.isInteger(value) || value < minimum) {
    throw new StatusError(CODE.INVALID_ARGUMENT, `setting '${name}' must be an integer >= ${minimum}, got ${value}`);
  }
  return value;
}

function checkSettings(settings, allowed) {
  const unknown = Object.keys(settings || {}).filter((key) => !allowed.includes(key));
  if (unknown.length) {
    throw new StatusError(CODE.INVALID_ARGUMENT, `unknown settings ${JSON.stringify(unknown)}; known: ${JSON.stringify(allowed)}`);
  }
}

class World {
  constructor(name, settings) {
    checkSettings(settings, ['seed', 'rows', 'columns', 'max_steps', 'num_agents']);
    const get = (key, fallback, minimum) => (key in settings ? integerSetting(key, settings[key], minimum) : fallback);
    this.name = name;
    this.rows = get('rows', 10, 2);
    this.columns = get('columns', 5, 1);
    this.seed = get('seed', 0, 0);
    this.maxSteps = get('max_steps', null, 1);
    this.numAgents = get('num_agents', 1, 1);
    this.random = rng(this.seed);
    this.joinedBy = null;
    this.resetNext = true;
    this.ball = [0, 0];
    this.paddle = Math.floor(this.columns / 2);
    this.steps = 0;
  }

  reseed(settings) {
    checkSettings(settings, ['seed']);
    if ('seed' in settings) {
      this.seed = integerSetting('seed', settings.seed, 0);
      this.random = rng(this.seed);
    }
    this.resetNext = true;
  }

  isJoined() {
    return this.joinedBy !== null;
  }

  specs() {
    const floatSpec = (name, shape, bounds) => {
      const spec = { name, shape, dtype: DTYPE.FLOAT };
      if (bounds) Object.assign(spec, { min: { floats: { array: [bounds[0]] } }, max: { floats: { array: [bounds[1]] } } });
      return spec;
    };
    return {
      actions: {
        [UID.paddle]: {
          name: 'paddle', shape: [], dtype: DTYPE.INT8,
          min: { int8s: { array: Buffer.from([0xff]) } }, max: { int8s: { array: Buffer.from([1]) } },
        },
      },
      observations: {
        [UID.board]: floatSpec('board', [this.rows, this.columns], [0, 1]),
        [UID.reward]: floatSpec('reward', [], null),
        [UID.discount]: floatSpec('discount', [], [0, 1]),
      },
    };
  }

  /** One step: returns [state, {uid: Tensor}]. */
  step(actions) {
    let reward = 0;
    let discount = 1;
    let state = STATE.RUNNING;
    if (this.resetNext) { // the first step of a sequence ignores its actions
      this.ball = [0, Math.floor(this.random() * this.columns)];
      this.paddle = Math.floor(this.columns / 2);
      this.steps = 0;
      this.resetNext = false;
    } else {
      const move = paddleMove(actions);
      this.paddle = Math.min(Math.max(this.paddle + move, 0), this.columns - 1);
      this.ball = [this.ball[0] + 1, this.ball[1]];
      this.steps += 1;
      if (this.ball[0] === this.rows - 1) {
        state = STATE.TERMINATED;
        reward = this.ball[1] === this.paddle ? 1 : -1;
        discount = 0;
        this.resetNext = true;
      } else if (this.maxSteps !== null && this.steps >= this.maxSteps) {
        state = STATE.INTERRUPTED;
        this.resetNext = true;
      }
    }
    const board = new Array(this.rows * this.columns).fill(0);
    board[this.ball[0] * this.columns + this.ball[1]] = 1;
    board[(this.rows - 1) * this.columns + this.paddle] = 1;
    return [state, {
      [UID.board]: { shape: [this.rows, this.columns], floats: { array: board } },
      [UID.reward]: { shape: [], floats: { array: [reward] } },
      [UID.discount]: { shape: [], floats: { array: [discount] } },
    }];
  }
}

/** A multi-agent world (num_agents >= 2): one paddle per agent under one ball, lockstep. */
class MultiWorld extends World {
  constructor(name, settings, agentTimeout) {
    super(name, settings);
    this.agents = new Array(this.numAgents).fill(null); // the joined sessions
    this.paddles = new Array(this.numAgents).fill(Math.floor(this.columns / 2));
    this.waiting = new Map(); // agent -> {move, answer} of the steps at the barrier
    this.timer = null;
    this.agentTimeout = agentTimeout;
    this.running = false; // a sequence is running (a FIRST step and no end since)
    this.interruptNext = false; // ResetWorld: the next round answers INTERRUPTED
  }

  isJoined() {
    return this.agents.some((session) => session !== null);
  }

  joined() {
    return this.agents.flatMap((session, agent) => (session === null ? [] : [agent]));
  }

  join(session, settings) {
    checkSettings(settings, ['agent']);
    let agent;
    if ('agent' in settings) {
      agent = integerSetting('agent', settings.agent, 0);
      if (agent >= this.numAgents) {
        throw new StatusError(CODE.INVALID_ARGUMENT, `agent ${agent} is out of range: world '${this.name}' has agents 0 to ${this.numAgents - 1}`);
      }
      if (this.agents[agent] !== null) {
        throw new StatusError(CODE.ALREADY_EXISTS, `agent_${agent} of world '${this.name}' is taken by another stream`);
      }
    } else {
      agent = this.agents.indexOf(null);
      if (agent < 0) {
        throw new StatusError(CODE.RESOURCE_EXHAUSTED, `world '${this.name}' is full: its ${this.numAgents} agents are all joined`);
      }
    }
    this.agents[agent] = session;
    this.resetNext = true;
    this.running = false;
    this.interruptNext = false;
    return agent;
  }

  leave(agent) {
    this.agents[agent] = null;
    this.waiting.delete(agent); // its stream is gone or done: nothing to answer
    this.maybeRound();
  }

  /** ResetWorld: re-seeds; a running sequence's next round is INTERRUPTED, then one starts. */
  reseed(settings) {
    const running = this.running;
    super.reseed(settings);
    this.interruptNext = running;
  }

  /** A joined agent's ResetRequest: the next round starts a sequence (FIRST). */
  restart(settings) {
    super.reseed(settings);
    this.running = false;
    this.interruptNext = false;
  }

  /** Agent `agent`'s step: `answer([state, observations] or an error response)` once every
   * joined agent has acted, or at the barrier's timeout. */
  arrive(agent, move, answer) {
    this.waiting.set(agent, { move, answer });
    if (this.timer === null) {
      const started = Date.now();
      this.timer = setTimeout(() => this.expire(started), this.agentTimeout * 1000);
    }
    this.maybeRound();
  }

  maybeRound() {
    const joined = this.joined();
    if (this.waiting.size === 0 || !joined.every((agent) => this.waiting.has(agent))) return;
    clearTimeout(this.timer);
    this.timer = null;
    const waiting = this.waiting;
    this.waiting = new Map();
    const results = this.round(waiting);
    for (const [agent, entry] of waiting) entry.answer(results.get(agent));
  }

  expire(started) {
    this.timer = null;
    const missing = this.joined().filter((agent) => !this.waiting.has(agent)).map((agent) => `agent_${agent}`);
    const seconds = ((Date.now() - started) / 1000).toFixed(1);
    const waiting = this.waiting;
    this.waiting = new Map();
    for (const [agent, entry] of waiting) {
      const message = `lockstep step of agent_${agent} waited ${seconds} s; agents that did not act: ${missing.join(', ')}`;
      entry.answer(errorResponse(new StatusError(CODE.DEADLINE_EXCEEDED, message)));
    }
  }

  /** One lockstep round with every waiting agent's move: agent -> [state, observations]. */
  round(waiting) {
    let state = STATE.RUNNING;
    let discount = 1;
    const rewards = new Array(this.numAgents).fill(0);
    if (this.interruptNext) {
      this.interruptNext = false;
      this.running = false;
      state = STATE.INTERRUPTED;
    } else if (this.resetNext) { // the first step of a sequence ignores its actions
      this.ball = [0, Math.floor(this.random() * this.columns)];
      this.paddles.fill(Math.floor(this.columns / 2));
      this.steps = 0;
      this.resetNext = false;
      this.running = true;
    } else {
      for (const [agent, entry] of waiting) {
        this.paddles[agent] = Math.min(Math.max(this.paddles[agent] + entry.move, 0), this.columns - 1);
      }
      this.ball = [this.ball[0] + 1, this.ball[1]];
      this.steps += 1;
      if (this.ball[0] === this.rows - 1) {
        state = STATE.TERMINATED;
        discount = 0;
        for (const agent of waiting.keys()) rewards[agent] = this.ball[1] === this.paddles[agent] ? 1 : -1;
        this.resetNext = true;
        this.running = false;
      } else if (this.maxSteps !== null && this.steps >= this.maxSteps) {
        state = STATE.INTERRUPTED;
        this.resetNext = true;
        this.running = false;
      }
    }
    const results = new Map();
    for (const agent of waiting.keys()) {
      const board = new Array(this.rows * this.columns).fill(0);
      board[this.ball[0] * this.columns + this.ball[1]] = 1;
      board[(this.rows - 1) * this.columns + this.paddles[agent]] = 1;
      results.set(agent, [state, {
        [UID.board]: { shape: [this.rows, this.columns], floats: { array: board } },
        [UID.reward]: { shape: [], floats: { array: [rewards[agent]] } },
        [UID.discount]: { shape: [], floats: { array: [discount] } },
      }]);
    }
    return results;
  }
}

function errorResponse(error) {
  const code = error instanceof StatusError ? error.code : 13;
  return { error: { code, message: error.message, details: [] } };
}

function paddleMove(actions) {
  const unknown = Object.keys(actions).filter((uid) => uid !== UID.paddle);
  if (unknown.length) {
    throw new StatusError(CODE.INVALID_ARGUMENT, `unknown action UIDs ${JSON.stringify(unknown)}; the actions are {1: paddle}`);
  }
  const tensor = actions[UID.paddle];
  if (tensor === undefined) return 0;
  if (tensor.payload !== 'int8s') {
    throw new StatusError(CODE.INVALID_ARGUMENT, `action 'paddle' must be int8, got ${tensor.payload || 'no payload'}`);
  }
  const bytes = tensor.int8s.array || Buffer.alloc(0);
  if (bytes.length !== 1 || (tensor.shape || []).length !== 0) {
    throw new StatusError(CODE.INVALID_ARGUMENT, `action 'paddle' must be one int8 of shape [], got ${bytes.length} of shape [${tensor.shape}]`);
  }
  const move = bytes.readInt8(0);
  if (move < -1 || move > 1) {
    throw new StatusError(CODE.INVALID_ARGUMENT, `action 'paddle' must be in [-1, 1], got ${move}`);
  }
  return move;
}

class Session {
  constructor(server, write) {
    this.server = server;
    this.world = null;
    this.agent = null; // in a multi-agent world: the agent joined
    this.write = write;
    this.queue = []; // requests not yet handled: they wait behind a step at a barrier
    this.busy = false;
    this.closed = false;
  }

  /** Handles requests in order; a multi-agent step holds the later ones until it is answered. */
  take(request) {
    this.queue.push(request);
    this.pump();
  }

  pump() {
    while (!this.busy && this.queue.length && !this.closed) {
      const request = this.queue.shift();
      let response;
      try {
        if (request.payload === 'step' && this.world instanceof MultiWorld) {
          this.busy = true;
          this.stepTogether(request.step || {});
          continue;
        }
        response = this.handle(request);
      } catch (error) {
        this.busy = false;
        response = errorResponse(error);
      }
      this.write(response);
    }
  }

  stepTogether(body) {
    const world = this.world;
    const requested = this.requested(world, body);
    // The round that starts a sequence (or answers INTERRUPTED) ignores every action.
    const ignored = world.resetNext || world.interruptNext;
    const move = ignored ? 0 : paddleMove(decimalKeys(body.actions));
    world.arrive(this.agent, move, (result) => {
      if (this.closed) return;
      let response = result;
      if (Array.isArray(result)) {
        const [state, observations] = result;
        const chosen = {};
        for (const uid of requested) chosen[uid] = observations[uid];
        response = { step: { state, observations: chosen } };
      }
      this.write(response);
      this.busy = false;
      this.pump();
    });
  }

  requested(world, body) {
    const requested = (body.requested_observations || []).map(String);
    const known = world.specs().observations;
    const missing = requested.filter((uid) => !(uid in known));
    if (missing.length) throw new StatusError(CODE.INVALID_ARGUMENT, `unknown observation UIDs ${JSON.stringify(missing)}`);
    return requested;
  }

  handle(request) {
    const kind = request.payload;
    const body = request[kind] || {};
    switch (kind) {
      case 'create_world': return { create_world: { world_name: this.server.create(body.settings || {}) } };
      case 'join_world': return { join_world: { specs: this.join(body) } };
      case 'step': return { step: this.step(body) };
      case 'reset': return { reset: { specs: this.reset(body) } };
      case 'reset_world': this.server.world(body.world_name).reseed(body.settings || {}); return { reset_world: {} };
      case 'leave_world': this.leave(); return { leave_world: {} };
      case 'destroy_world': this.server.destroy(body.world_name); return { destroy_world: {} };
      default: throw new StatusError(CODE.UNIMPLEMENTED, `this server does not serve ${kind || 'an empty request'}`);
    }
  }

  join(body) {
    if (this.world) throw new StatusError(CODE.FAILED_PRECONDITION, `this stream already joined world '${this.world.name}'; leave it first`);
    const world = this.server.world(body.world_name);
    if (world instanceof MultiWorld) {
      this.agent = world.join(this, body.settings || {});
      this.world = world;
      return world.specs();
    }
    checkSettings(body.settings, []);
    if (world.joinedBy) throw new StatusError(CODE.FAILED_PRECONDITION, `world '${world.name}' is joined by another stream`);
    world.joinedBy = this;
    world.resetNext = true;
    this.world = world;
    return world.specs();
  }

  joined() {
    if (!this.world) throw new StatusError(CODE.FAILED_PRECONDITION, 'join a world first');
    return this.world;
  }

  step(body) {
    const world = this.joined();
    const requested = this.requested(world, body);
    const actions = decimalKeys(body.actions);
    const [state, observations] = world.step(actions);
    const chosen = {};
    for (const uid of requested) chosen[uid] = observations[uid];
    return { state, observations: chosen };
  }

  reset(body) {
    const world = this.joined();
    if (world instanceof MultiWorld) world.restart(body.settings || {});
    else world.reseed(body.settings || {});
    return world.specs();
  }

  leave() {
    const world = this.world;
    this.world = null;
    if (world instanceof MultiWorld) world.leave(this.agent);
    else if (world) world.joinedBy = null;
    this.agent = null;
  }
}

class Server {
  constructor(maxWorlds, agentTimeout) {
    this.worlds = new Map();
    this.made = 0;
    this.maxWorlds = maxWorlds;
    this.agentTimeout = agentTimeout;
  }

  create(settings) {
    if (this.maxWorlds && this.worlds.size >= this.maxWorlds) {
      throw new StatusError(CODE.RESOURCE_EXHAUSTED, `this server holds at most ${this.maxWorlds} worlds; destroy one first`);
    }
    const name = `world_${this.made}`;
    let world = new World(name, settings);
    if (world.numAgents > 1) world = new MultiWorld(name, settings, this.agentTimeout);
    this.made += 1;
    this.worlds.set(name, world);
    return name;
  }

  world(name) {
    const world = this.worlds.get(name);
    if (!world) throw new StatusError(CODE.NOT_FOUND, `no world named '${name}'`);
    return world;
  }

  destroy(name) {
    const world = this.world(name);
    if (world.isJoined()) throw new StatusError(CODE.FAILED_PRECONDITION, `world '${name}' is joined; leave it first`);
    this.worlds.delete(name);
  }
}

function main() {
  const args = parseArgs(process.argv.slice(2));
  const definition = protoLoader.loadSync('dm_env_rpc/v1/dm_env_rpc.proto', {
    keepCase: true, longs: String, enums: Number, defaults: false, oneofs: true,
    includeDirs: [args.protoRoot, ...args.include],
  });
  const service = grpc.loadPackageDefinition(definition).dm_env_rpc.v1.Environment.service;
  const state = new Server(args.maxWorlds, args.agentTimeout);
  const options = {};
  if (args.maxStreams > 0) options['grpc.max_concurrent_streams'] = args.maxStreams;
  const server = new grpc.Server(options);
  server.addService(service, {
    Process(call) {
      const session = new Session(state, (response) => call.write(response));
      call.on('data', (request) => session.take(request));
      const end = () => { // the world stays until it is destroyed
        session.closed = true;
        session.leave();
      };
      call.on('end', () => { end(); call.end(); });
      call.on('cancelled', end);
      call.on('error', end);
    },
  });
  server.bindAsync(`${args.host}:${args.port}`, grpc.ServerCredentials.createInsecure(), (error, port) => {
    if (error) {
      process.stderr.write(`cannot listen: ${error.message}\n`);
      process.exit(1);
    }
    process.stdout.write(`${JSON.stringify({ port })}\n`);
  });
  // Never outlive the process that started it: stdin closes when it dies, even by SIGKILL,
  // and the parent pid changes (to init or a subreaper) at that moment too.
  const parent = process.ppid;
  process.stdin.on('end', () => process.exit(0));
  process.stdin.on('error', () => process.exit(0));
  process.stdin.resume();
  setInterval(() => { if (process.ppid !== parent) process.exit(0); }, 200).unref();
  process.on('SIGTERM', () => server.tryShutdown(() => process.exit(0)));
}

main();
