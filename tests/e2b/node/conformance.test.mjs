// kiln's E2B conformance suite for the npm SDKs (`e2b`, `@e2b/code-interpreter`), unchanged,
// against a running `kiln serve --e2b-listen` (scripts/e2b-check sets E2B_API_KEY,
// E2B_API_URL and E2B_SANDBOX_URL). Run with `node --test`.
import assert from 'node:assert/strict'
import { after, test } from 'node:test'

import { CommandExitError, Sandbox, Secret, Volume } from 'e2b'
import { Sandbox as CodeInterpreter } from '@e2b/code-interpreter'

const made = []
after(async () => {
  for (const sbx of made) await sbx.kill().catch(() => {})
})

async function base(opts = {}) {
  const sbx = await Sandbox.create('base', { metadata: { suite: 'node' }, ...opts })
  made.push(sbx)
  return sbx
}

test('lifecycle: create, info, timeout, list, kill', async () => {
  const sbx = await base({ metadata: { suite: 'node', case: 'lifecycle' } })
  assert.ok(await sbx.isRunning())
  const info = await sbx.getInfo()
  assert.equal(info.sandboxId, sbx.sandboxId)
  assert.equal(info.templateId, 'base')
  assert.deepEqual(info.metadata, { suite: 'node', case: 'lifecycle' })
  await sbx.setTimeout(120_000)
  const listed = await Sandbox.list({ query: { metadata: { case: 'lifecycle' } } }).nextItems()
  assert.deepEqual(listed.map((s) => s.sandboxId), [sbx.sandboxId])
  await sbx.kill()
  assert.equal(await sbx.isRunning(), false)
})

test('files: write, read, list, exists, makeDir, rename, remove', async () => {
  const sbx = await base()
  await sbx.files.write('hello.txt', 'Hello from node')
  assert.equal(await sbx.files.read('hello.txt'), 'Hello from node')
  const bytes = new Uint8Array([0, 1, 2, 250])
  await sbx.files.write('bin.dat', bytes)
  assert.deepEqual(await sbx.files.read('bin.dat', { format: 'bytes' }), bytes)
  assert.deepEqual((await sbx.files.list('.')).map((e) => e.name).sort(), ['bin.dat', 'hello.txt'])
  assert.equal(await sbx.files.exists('hello.txt'), true)
  assert.equal(await sbx.files.exists('nope.txt'), false)
  assert.equal(await sbx.files.makeDir('a/b'), true)
  assert.equal(await sbx.files.makeDir('a/b'), false)
  const moved = await sbx.files.rename('hello.txt', 'a/b/moved.txt')
  assert.equal(moved.path, '/home/user/a/b/moved.txt')
  await sbx.files.remove('a')
  assert.equal(await sbx.files.exists('a/b/moved.txt'), false)
  await assert.rejects(sbx.files.read('/etc/passwd'), /outside \/home\/user/)
})

test('commands: output, env, exit codes, background, kill', async () => {
  const sbx = await base()
  const result = await sbx.commands.run('echo $GREETING; python3 -c "print(6*7)"', { envs: { GREETING: 'hi' } })
  assert.equal(result.stdout, 'hi\n42\n')
  await assert.rejects(sbx.commands.run('exit 4'), (e) => e instanceof CommandExitError && e.exitCode === 4)
  const chunks = []
  await sbx.commands.run('echo a; echo b', { onStdout: (d) => chunks.push(d) })
  assert.equal(chunks.join(''), 'a\nb\n')
  const handle = await sbx.commands.run('sleep 60', { background: true })
  assert.ok((await sbx.commands.list()).some((p) => p.pid === handle.pid))
  assert.equal(await sbx.commands.kill(handle.pid), true)
})

test('pty: an interactive shell', async () => {
  const sbx = await base()
  let out = ''
  const terminal = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => { out += new TextDecoder().decode(d) } })
  await sbx.pty.sendInput(terminal.pid, new TextEncoder().encode('echo pty-$((40+2)); exit\n'))
  await terminal.wait()
  assert.match(out, /pty-42/)
})

test('code interpreter: results, state, errors, charts, javascript', async () => {
  const sbx = await CodeInterpreter.create({ metadata: { suite: 'node' } })
  made.push(sbx)
  const first = await sbx.runCode('x = 41\nx + 1')
  assert.equal(first.text, '42')
  const printed = await sbx.runCode('print("Hello")')
  assert.deepEqual(printed.logs.stdout, ['Hello\n'])
  const failed = await sbx.runCode('1/0')
  assert.equal(failed.error.name, 'ZeroDivisionError')
  const chart = await sbx.runCode('import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()')
  assert.equal(chart.results.filter((r) => r.png).length, 1)
  const js = await sbx.runCode('var n = 20; n * 2 + 2', { language: 'javascript' })
  assert.equal(js.text, '42')
  const contexts = await sbx.listCodeContexts()
  assert.ok(contexts.some((c) => c.language === 'python'))
})

test('network rules: allowOut/denyOut at create, updateNetwork, getInfo', async () => {
  const sbx = await base({ network: { allowOut: ['pypi.org'], denyOut: ['0.0.0.0/0'] } })
  const info = await sbx.getInfo()
  assert.deepEqual(info.network.allowOut, ['pypi.org'])
  const refused = await sbx.commands.run('curl -s http://registry.npmjs.org/')
  assert.match(refused.stdout, /refused by this sandbox's denyOut entry "0\.0\.0\.0\/0"/)
  await sbx.updateNetwork({ denyOut: ['registry.npmjs.org'] })
  const again = await sbx.commands.run('curl -s http://registry.npmjs.org/')
  assert.match(again.stdout, /denyOut entry "registry\.npmjs\.org"/)
  await assert.rejects(base({ network: { allowOut: ['not a host'] } }), /not a destination/)
})

test('secrets: create, list, never read back, destroy', async () => {
  const name = `node-${Date.now()}`
  const made = await Secret.create(name, 'sk-node-value')
  assert.equal(made.name, name)
  assert.ok(!JSON.stringify(made).includes('sk-node-value'))
  assert.equal(Secret.fill(name), `\${e2b.secrets.${name}}`)
  assert.ok(await Secret.destroy(name))
  assert.equal(await Secret.destroy(name), false)
})

test('volumes: a volume mounted in two sandboxes, its files through the volume API', async () => {
  const vol = await Volume.create(`node-${Date.now()}`)
  try {
    await vol.writeFile('/from-api.txt', 'api')
    const a = await base({ volumeMounts: { '/mnt/v': vol } })
    await a.commands.run('echo box > /mnt/v/from-box.txt')
    const b = await base({ volumeMounts: { '/data': vol.name } })
    assert.equal((await b.commands.run('cat /data/from-api.txt /data/from-box.txt')).stdout, 'apibox\n')
    assert.equal(await vol.readFile('/from-box.txt'), 'box\n')
    await assert.rejects(Volume.destroy(vol.volumeId), /mounted by live sandboxes/)
    await a.kill()
    await b.kill()
  } finally {
    await Volume.destroy(vol.volumeId).catch(() => {})
  }
})

test('snapshots and forks: files and running processes copied, copies diverge', async () => {
  const sbx = await base()
  await sbx.commands.run('echo base > state.txt')
  // A running process with its state in memory (a shell variable), started in the
  // background: the copies have it, going on.
  await sbx.commands.run('sh -c \'x=$$; while :; do echo "$x" > pid.txt; sleep 0.05; done\'', { background: true })
  await sbx.commands.run('for i in $(seq 50); do test -s pid.txt && break; sleep 0.05; done')
  const kept = (await sbx.commands.run('cat pid.txt')).stdout
  const snapshot = await sbx.createSnapshot()
  const copy = await Sandbox.create(snapshot.snapshotId)
  made.push(copy)
  assert.equal((await copy.commands.run('cat state.txt')).stdout, 'base\n')
  await copy.commands.run('rm pid.txt; for i in $(seq 50); do test -s pid.txt && break; sleep 0.05; done')
  assert.equal((await copy.commands.run('cat pid.txt')).stdout, kept, 'the copy\'s loop did not go on')
  const forks = await sbx.fork({ count: 2 })
  assert.equal(forks.length, 2)
  for (const [i, fork] of forks.entries()) {
    assert.ok(fork instanceof Sandbox, String(fork))
    made.push(fork)
    await fork.commands.run(`echo fork-${i} > state.txt`)
  }
  for (const [i, fork] of forks.entries()) {
    assert.equal((await fork.commands.run('cat state.txt')).stdout, `fork-${i}\n`)
  }
  assert.equal((await sbx.commands.run('cat state.txt')).stdout, 'base\n')
  assert.ok(await Sandbox.deleteSnapshot(snapshot.snapshotId))
})
