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
 *               after that many steps); Reset and ResetWorld: seed
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
 *          [--max-concurrent-streams N] [--max-worlds N]
 * Prints one line `{"port": N}` on stdout once it listens. It exits when its stdin closes or
 * its parent process changes (the process that started it died, even by SIGKILL).
 */

const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');

const CODE = {
  INVALID_ARGUMENT: 3,
  NOT_FOUND: 5,
  FAILED_PRECONDITION: 9,
  RESOURCE_EXHAUSTED: 8,
  UNIMPLEMENTED: 12,
};
const STATE = { RUNNING: 1, TERMINATED: 2, INTERRUPTED: 3 };
const DTYPE = { FLOAT: 1, INT8: 3 };
const UID = { paddle: '1', board: '1', reward: '2', discount: '3' };

function parseArgs(argv) {
  const args = { port: 0, host: '127.0.0.1', protoRoot: null, include: [], maxStreams: 0, maxWorlds: 0 };
  for (let i = 0; i < argv.length; i += 2) {
    const [flag, value] = [argv[i], argv[i + 1]];
    if (value === undefined) throw new Error(`${flag} needs a value`);
    if (flag === '--port') args.port = Number(value);
    else if (flag === '--host') args.host = value;
    else if (flag === '--proto-root') args.protoRoot = value;
    else if (flag === '--include') args.include.push(value);
    else if (flag === '--max-concurrent-streams') args.maxStreams = Number(value);
    else if (flag === '--max-worlds') args.maxWorlds = Number(value);
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
    checkSettings(settings, ['seed', 'rows', 'columns', 'max_steps']);
    const get = (key, fallback, minimum) => (key in settings ? integerSetting(key, settings[key], minimum) : fallback);
    this.name = name;
    this.rows = get('rows', 10, 2);
    this.columns = get('columns', 5, 1);
    this.seed = get('seed', 0, 0);
    this.maxSteps = get('max_steps', null, 1);
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
  constructor(server) {
    this.server = server;
    this.world = null;
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
    const requested = (body.requested_observations || []).map(String);
    const known = world.specs().observations;
    const missing = requested.filter((uid) => !(uid in known));
    if (missing.length) throw new StatusError(CODE.INVALID_ARGUMENT, `unknown observation UIDs ${JSON.stringify(missing)}`);
    const actions = decimalKeys(body.actions);
    const [state, observations] = world.step(actions);
    const chosen = {};
    for (const uid of requested) chosen[uid] = observations[uid];
    return { state, observations: chosen };
  }

  reset(body) {
    const world = this.joined();
    world.reseed(body.settings || {});
    return world.specs();
  }

  leave() {
    if (this.world) this.world.joinedBy = null;
    this.world = null;
  }
}

class Server {
  constructor(maxWorlds) {
    this.worlds = new Map();
    this.made = 0;
    this.maxWorlds = maxWorlds;
  }

  create(settings) {
    if (this.maxWorlds && this.worlds.size >= this.maxWorlds) {
      throw new StatusError(CODE.RESOURCE_EXHAUSTED, `this server holds at most ${this.maxWorlds} worlds; destroy one first`);
    }
    const name = `world_${this.made}`;
    const world = new World(name, settings);
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
    if (world.joinedBy) throw new StatusError(CODE.FAILED_PRECONDITION, `world '${name}' is joined; leave it first`);
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
  const state = new Server(args.maxWorlds);
  const options = {};
  if (args.maxStreams > 0) options['grpc.max_concurrent_streams'] = args.maxStreams;
  const server = new grpc.Server(options);
  server.addService(service, {
    Process(call) {
      const session = new Session(state);
      call.on('data', (request) => {
        let response;
        try {
          response = session.handle(request);
        } catch (error) {
          const code = error instanceof StatusError ? error.code : 13;
          response = { error: { code, message: error.message, details: [] } };
        }
        call.write(response);
      });
      const end = () => session.leave(); // the world stays until it is destroyed
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
